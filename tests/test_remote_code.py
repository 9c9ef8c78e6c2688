"""A saved checkpoint carries its code: it loads with trust_remote_code where this project is not importable."""

import json
import site
import subprocess
import sys
import textwrap

import torch

from modeling_nsa import NSAConfig, NSAForCausalLM

TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3,
    window_size=20, cmp_mlp_hidden_size=32, nsa_backend="reference",
)  # fmt: skip

# Runs with `python -S` and only site-packages on sys.path (no .pth files, so no editable install
# of this project and no repository directory): the checkpoint's own code is all there is.
CHILD = textwrap.dedent(
    """
    import sys
    sys.path[:] = [p for p in sys.path if p] + SITE_PACKAGES
    try:
        import modeling_nsa
    except ImportError:
        pass
    else:
        raise SystemExit("modeling_nsa is importable in the child: the test would prove nothing")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(CKPT, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    ids = torch.load(CKPT + "/ids.pt")
    with torch.no_grad():
        logits = model(ids).logits
    torch.save(logits, CKPT + "/child_logits.pt")
    generated = model.generate(ids[:, :6], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.save(generated, CKPT + "/child_generated.pt")
    base = AutoModel.from_pretrained(CKPT, trust_remote_code=True)
    print("BASE", type(base).__name__)
    """
)


def test_checkpoint_loads_with_trust_remote_code_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig(**TINY)).eval()
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)

    config = json.loads((ckpt / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_nsa.NSAConfig",
        "AutoModel": "modeling_nsa.NSAModel",
        "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM",
    }
    for module in ("configuration_nsa.py", "modeling_nsa.py", "nsa_layout.py", "nsa_reference.py", "nsa_triton.py"):
        assert (ckpt / module).is_file(), f"{module} was not copied into the checkpoint"
    assert (ckpt / "model.safetensors").is_file()

    ids = torch.randint(0, 101, (2, 45))
    torch.save(ids, ckpt / "ids.pt")
    with torch.no_grad():
        expected = model(ids).logits
    expected_generated = model.generate(ids[:, :6], max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)

    prelude = f"CKPT = {str(ckpt)!r}\nSITE_PACKAGES = {site.getsitepackages()!r}\n"
    result = subprocess.run(
        [sys.executable, "-S", "-c", prelude + CHILD], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "BASE NSAModel" in result.stdout
    torch.testing.assert_close(torch.load(ckpt / "child_logits.pt"), expected, rtol=0, atol=0)
    assert torch.equal(torch.load(ckpt / "child_generated.pt"), expected_generated)
