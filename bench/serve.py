"""The built book served on the loopback interface, as a static host would serve it.

    make serve    # or: python -m bench.serve [--port 8000] [--directory _build/html]

Browsers refuse WebAssembly and module workers on `file://` pages, so the page that runs the
reader's own prompt (book/your_prompt.md) needs a server. This one binds 127.0.0.1 only. With
`isolated` (the default) it also sends the two headers that make a page cross-origin isolated
(COOP and COEP), which lets onnxruntime-web run on several threads; without them the page runs on
one, as on a static host that cannot send headers. The page test and the page's benchmark start
one in a thread (`serve`), on a free port.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout
ISOLATION = {"Cross-Origin-Opener-Policy": "same-origin",
             "Cross-Origin-Embedder-Policy": "require-corp"}


class Handler(http.server.SimpleHTTPRequestHandler):
    isolated = True
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".wasm": "application/wasm",
                      ".json": "application/json"}

    def end_headers(self):
        # never kept by the browser: a weight file replaced on disk is what the page checks next
        # (a Last-Modified of whole seconds cannot tell two quick changes apart)
        self.send_header("Cache-Control", "no-store")
        if self.isolated:
            for k, v in ISOLATION.items():
                self.send_header(k, v)
        super().end_headers()

    def log_message(self, *args):  # quiet: a page load makes a hundred requests
        pass


class Server:
    """A running server in a daemon thread: `url`, then `stop()` (or use it in a with block)."""

    def __init__(self, directory: Path, port: int = 0, isolated: bool = True):
        handler = type("Handler", (Handler,), {"isolated": isolated})
        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", port), functools.partial(handler, directory=str(directory)))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve(directory: Path, port: int = 0, isolated: bool = True) -> Server:
    return Server(directory, port, isolated)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--directory", default=str(ROOT / "_build" / "html"))
    p.add_argument("--single-thread", action="store_true",
                   help="send no COOP/COEP headers, as a static host (the page runs on one thread)")
    args = p.parse_args(argv)
    site = Path(args.directory)
    if not (site / "index.html").is_file():
        print(f"error: no built book in {site}: run `make book` first", file=sys.stderr)
        sys.exit(2)
    try:
        server = serve(site, args.port, not args.single_thread)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{args.port} ({e.strerror}): "
              f"pick another port, e.g. `make serve PORT=8001`", file=sys.stderr)
        sys.exit(2)
    print(f"serving {site} at {server.url}/ (Ctrl-C stops it); "
          f"your own prompt: {server.url}/book/your_prompt.html")
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.stop()
        sys.exit(130)


if __name__ == "__main__":
    main()
