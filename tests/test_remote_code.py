"""A saved checkpoint carries its code: it loads with trust_remote_code where this project is not importable,
nor triton (a CPU machine without the kernels' dependency), and runs there on the PyTorch reference."""

import json
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import modeling_nsa
from modeling_nsa import NSAConfig, NSAForCausalLM

TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, cmp_block_size=8, cmp_stride=4, sel_block_size=16, sel_num_blocks=3,
    window_size=20, cmp_mlp_hidden_size=32, nsa_backend="reference",
)  # fmt: skip

# Runs with `python -S` and only site-packages on sys.path (no .pth files, so no editable install
# of this project and no repository directory): the checkpoint's own code is all there is. An import hook
# makes `import triton` fail as on a machine without it. The model is loaded with nsa_backend="auto", so the
# backend choice imports the checkpoint's kernel files (each guards its triton import) and picks the reference.
CHILD = textwrap.dedent(
    """
    import importlib, sys
    sys.path[:] = [p for p in sys.path if p] + SITE_PACKAGES

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked in this child)")
            return None

    sys.meta_path.insert(0, NoTriton())
    for blocked in ("modeling_nsa", "triton"):
        try:
            importlib.import_module(blocked)
        except ImportError:
            pass
        else:
            raise SystemExit(f"{blocked} is importable in the child: the test would prove nothing")
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(CKPT, trust_remote_code=True, nsa_backend="auto").eval()
    package = type(model).__module__.rsplit(".", 1)[0]
    assert package.startswith("transformers_modules"), package
    kernels = importlib.import_module(package + ".nsa_triton")
    assert not kernels._HAS_TRITON
    print("KERNELS", kernels.triton_unusable_reason("cpu"))
    print("LOADED", sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith(package + ".")))
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
    assert getattr(model.config, "auto_map", None) is None  # saving wrote the map to the file, not to the model

    config = json.loads((ckpt / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_nsa.NSAConfig",
        "AutoModel": "modeling_nsa.NSAModel",
        "AutoModelForCausalLM": "modeling_nsa.NSAForCausalLM",
    }
    # every file of the package but __init__.py: modeling_nsa.py and, through their relative imports, its
    # siblings (the backend choice, the cache, the layout, the reference and the kernel files)
    package = {p.name for p in Path(modeling_nsa.__file__).parent.glob("*.py")} - {"__init__.py"}
    copied = {p.name for p in ckpt.glob("*.py")}
    assert copied == package, (f"missing from the checkpoint: {sorted(package - copied)}; "
                               f"not in the package: {sorted(copied - package)}")
    assert {"nsa_backend.py", "nsa_triton.py", "nsa_triton_common.py", "nsa_triton_launch.py", "nsa_triton_decode.py",
            "nsa_triton_interval.py", "nsa_triton_topn.py", "nsa_triton_selected.py", "nsa_triton_dq.py"} <= copied
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
    assert "KERNELS Triton is not installed" in result.stdout, result.stdout
    loaded = next(line for line in result.stdout.splitlines() if line.startswith("LOADED"))
    assert all(f"'{name[:-3]}'" in loaded for name in copied), (loaded, copied)  # every copied file imported
    torch.testing.assert_close(torch.load(ckpt / "child_logits.pt"), expected, rtol=0, atol=0)
    assert torch.equal(torch.load(ckpt / "child_generated.pt"), expected_generated)
