"""The field's evaluation tools on an exported checkpoint, offline: lm-evaluation-harness (a log-likelihood and a
generation task from tests/data/lm_eval_tiny, batched) and transformers' text-generation pipeline with a
TextStreamer. Both run in a fresh process where this project is not importable, so the checkpoint's own code
(trust_remote_code) is all they can load; their numbers and texts are checked against the model run here.
"""

import json
import math
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import GPT2, needs_shared

pytestmark = needs_shared
TASKS = Path(__file__).resolve().parent / "data" / "lm_eval_tiny"
MAX_GEN_TOKS = 8  # nsa_tiny_generate.yaml's max_gen_toks
PIPELINE_PROMPTS = ["Once upon a time", "The history of the city of"]  # two lengths: the batch is padded

CHILD = """
import contextlib, io, json, sys
sys.path[:] = [p for p in sys.path if p] + SITE_PACKAGES  # no .pth files: no editable install, no checkout
try:
    import modeling_nsa
except ImportError:
    pass
else:
    raise SystemExit("modeling_nsa is importable in the child: the test would prove nothing")
out = {}
if RUN_LM_EVAL:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model="hf", model_args=f"pretrained={CKPT},trust_remote_code=True",
                              tasks=["nsa_tiny_choice", "nsa_tiny_generate"], batch_size=2, device="cpu",
                              task_manager=TaskManager(include_path=TASKS), log_samples=True)
    out["results"] = results["results"]
    out["samples"] = {task: [{"doc": s["doc"], "resps": s["resps"]} for s in samples]
                      for task, samples in results["samples"].items()}
from transformers import TextStreamer, pipeline

generator = pipeline("text-generation", model=CKPT, trust_remote_code=True)
out["pipeline_class"] = type(generator.model).__module__
streamed = io.StringIO()
with contextlib.redirect_stdout(streamed):
    result = generator(PROMPTS[0], max_new_tokens=12, do_sample=False,
                       streamer=TextStreamer(generator.tokenizer, skip_prompt=True))
out["streamed"], out["pipeline_single"] = streamed.getvalue(), result[0]["generated_text"]
batched = generator(PROMPTS, max_new_tokens=12, do_sample=False, batch_size=2)
out["pipeline_batched"] = [r[0]["generated_text"] for r in batched]
out["remote_modules"] = sorted(m for m in sys.modules if m.startswith("transformers_modules") and "modeling_nsa" in m)
json.dump(out, open(OUT, "w"))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny NSA model (the trainer's `tiny` preset, random weights) exported the way the trainer exports final/."""
    import train_accelerate
    from modeling_nsa import NSAConfig, NSAForCausalLM
    from nsa_train import checkpoint, data

    tokenizer = data.load_tokenizer(str(GPT2))
    torch.manual_seed(0)
    config = NSAConfig(**train_accelerate.MODEL_PRESETS["tiny"], vocab_size=math.ceil(len(tokenizer) / 64) * 64,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = NSAForCausalLM(config).eval()
    ckpt = checkpoint.export_hf_checkpoint(model, tokenizer, tmp_path_factory.mktemp("smoke") / "final")
    return ckpt, model, tokenizer


def run_child(ckpt: Path, tmp_path: Path, run_lm_eval: bool) -> dict:
    out = tmp_path / "child.json"
    prelude = (f"CKPT = {str(ckpt)!r}\nTASKS = {str(TASKS)!r}\nOUT = {str(out)!r}\nPROMPTS = {PIPELINE_PROMPTS!r}\n"
               f"SITE_PACKAGES = {site.getsitepackages()!r}\nRUN_LM_EVAL = {run_lm_eval}\n")  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    # cwd: the tasks' data_files (choice.jsonl, generate.jsonl) are relative to it
    child = subprocess.run([sys.executable, "-S", "-c", prelude + CHILD], cwd=TASKS, env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def child(exported, tmp_path_factory):
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        has_lm_eval = False
    else:
        has_lm_eval = True
    return run_child(exported[0], tmp_path_factory.mktemp("child"), run_lm_eval=has_lm_eval)


def lm_eval_results(child) -> dict:
    if "results" not in child:
        pytest.skip("lm-eval is not installed (pip install -e '.[eval]')")
    return child["results"]


def greedy(model, tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_tools_use_the_checkpoint_code(child):
    assert child["remote_modules"] and all(m.startswith("transformers_modules.") for m in child["remote_modules"])
    assert child["pipeline_class"].startswith("transformers_modules.")


def test_lm_eval_loglikelihood_task(child, exported):
    _, model, tokenizer = exported
    metrics = lm_eval_results(child)["nsa_tiny_choice"]
    assert 0.0 <= metrics["acc,none"] <= 1.0 and 0.0 <= metrics["acc_norm,none"] <= 1.0
    samples = child["samples"]["nsa_tiny_choice"]
    assert len(samples) == 5
    for sample in samples:  # each choice's log-likelihood, computed in batches of 2, is the model's own
        question = sample["doc"]["question"]
        for choice, ((loglik, _greedy),) in zip(sample["doc"]["choices"], sample["resps"]):
            whole = tokenizer(f"{question} {choice}").input_ids
            n_context = len(tokenizer(question).input_ids)
            with torch.no_grad():
                logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
            expected = sum(float(logprobs[i - 1, whole[i]]) for i in range(n_context, len(whole)))
            assert float(loglik) == pytest.approx(expected, abs=1e-3), (question, choice)


def test_lm_eval_generation_task(child, exported):
    _, model, tokenizer = exported
    assert 0.0 <= lm_eval_results(child)["nsa_tiny_generate"]["exact_match,none"] <= 1.0
    samples = child["samples"]["nsa_tiny_generate"]
    assert len(samples) == 5
    for sample in samples:  # batched, left-padded generation gives the model's own greedy text, max_gen_toks long
        (response,) = sample["resps"][0]
        expected = greedy(model, tokenizer, sample["doc"]["prompt"], MAX_GEN_TOKS).split("\n")[0]
        assert isinstance(response, str) and response == expected, (sample["doc"]["prompt"], response, expected)


def test_pipeline_and_text_streamer(child, exported):
    _, model, tokenizer = exported
    continuation = greedy(model, tokenizer, PIPELINE_PROMPTS[0], 12)
    assert child["pipeline_single"] == PIPELINE_PROMPTS[0] + continuation
    assert child["streamed"] == continuation + "\n"  # TextStreamer prints the new text, then ends the line
    expected = [p + greedy(model, tokenizer, p, 12) for p in PIPELINE_PROMPTS]
    assert child["pipeline_batched"] == expected  # padded on the left by the exported tokenizer


def test_lm_eval_scores_a_byte_level_export_with_the_readmes_flag(tmp_path):
    """A byte-level export (the smoke preset's ByT5 tokenizer) appends </s> to every text it encodes, and lm-eval
    passes the tokenizer's default: the context would end in </s> and the continuation lose its first byte. The
    README's `add_bos_token=False` (lm-eval: add_special_tokens=False) scores the continuation's own bytes."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM
    from transformers import ByT5Tokenizer

    from modeling_nsa import NSAConfig, NSAForCausalLM
    from nsa_train import checkpoint

    tokenizer = ByT5Tokenizer()
    config = NSAConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, cmp_block_size=4, cmp_stride=2, sel_block_size=4,
                       sel_num_blocks=3, window_size=8, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    ckpt = checkpoint.export_hf_checkpoint(NSAForCausalLM(config), tokenizer, tmp_path / "final")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    card = (Path(__file__).resolve().parents[1] / "model_cards" / "nsa_model_card.md").read_text()
    assert "trust_remote_code=True,add_bos_token=False" in readme  # the by-hand commands pass it
    assert "trust_remote_code=True,add_bos_token=False" in card  # and so does every exported model's card

    def encoded(**args):
        lm = HFLM(pretrained=str(ckpt), trust_remote_code=True, batch_size=1, device="cpu", **args)
        return [lm.tok_decode(ids) for ids in lm._encode_pair("The cat", " sat")]

    assert encoded(add_bos_token=False) == ["The cat", " sat"]
    assert encoded() != ["The cat", " sat"]  # (why the flag is there: 'The cat</s>', 'sat</s>')
