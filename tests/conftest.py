import pytest

from llmtrace import load_model, meta_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def embedded():
    return load_model("embedded")


@pytest.fixture(scope="session")
def prompt_trace(embedded):
    """One traced prefill of the prompt on the embedded model: (logits, trace)."""
    return embedded.run(PROMPT)


@pytest.fixture(scope="session")
def tiny_meta():
    return meta_model("tinyllama-1.1b")


@pytest.fixture(scope="session")
def hf_reference(embedded):
    """HF transformers' LlamaForCausalLM, eager attention, on the same fp32 weights."""
    from bench.reference import hf_reference

    return hf_reference(embedded, "eager")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama checkpoint in HF format (2 layers, hidden 64, GQA 4/2), made by HF."""
    from tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    return load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def llama_tok():
    from llmtrace.weights.tokenizer_llama import llama_tokenizer

    return llama_tokenizer()
