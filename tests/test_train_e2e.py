"""End to end: `--preset smoke` from the command line, pushed to a loopback stand-in of the Hub, then loaded in a
fresh process with trust_remote_code and used to generate; the Hub preflight's early failures."""

import base64
import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from train_helpers import REPO, free_port, run_cli

from nsa_train import hub


class FakeHub:
    """The endpoints huggingface_hub's whoami / create_repo / upload_folder call, recording what arrives."""

    def __init__(self, token="hf_test_token", user="tester"):
        self.token, self.user = token, user
        self.repos, self.commits, self.requests = set(), [], []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorized(self):
                return self.headers.get("Authorization") == f"Bearer {fake.token}"

            def do_GET(self):
                fake.requests.append(("GET", self.path))
                if self.path.startswith("/api/whoami-v2"):
                    if not self._authorized():
                        return self._json(401, {"error": "Invalid credentials in Authorization header"})
                    return self._json(200, {"type": "user", "name": fake.user, "auth": {"accessToken": {"role": "write"}}})
                self._json(404, {"error": f"not found: {self.path}"})

            def do_POST(self):
                fake.requests.append(("POST", self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self._authorized():
                    return self._json(401, {"error": "unauthorized"})
                if self.path == "/api/repos/create":
                    payload = json.loads(body)
                    repo = f"{payload['organization'] or fake.user}/{payload['name']}"
                    fake.repos.add(repo)
                    return self._json(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
                if self.path == "/api/validate-yaml":
                    return self._json(200, {"errors": [], "warnings": []})
                parts = self.path.split("?")[0].split("/")  # /api/models/{org}/{name}/{preupload|commit}/{rev}
                if len(parts) >= 7 and parts[1:3] == ["api", "models"] and f"{parts[3]}/{parts[4]}" in fake.repos:
                    if parts[5] == "preupload":
                        files = json.loads(body)["files"]
                        return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False, "oid": None} for f in files]})  # fmt: skip
                    if parts[5] == "commit":
                        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                        header = next(x["value"] for x in lines if x["key"] == "header")
                        files = {x["value"]["path"]: base64.b64decode(x["value"]["content"])
                                 for x in lines if x["key"] == "file"}  # fmt: skip
                        fake.commits.append({"repo": f"{parts[3]}/{parts[4]}", "revision": parts[6],
                                             "message": header["summary"], "files": files})  # fmt: skip
                        return self._json(200, {"commitUrl": f"http://{self.headers['Host']}/{parts[3]}/{parts[4]}/commit/{'a' * 40}",
                                                "commitOid": "a" * 40, "pullRequestUrl": None})  # fmt: skip
                self._json(404, {"error": f"not found: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture
def fake_hub():
    server = FakeHub()
    yield server
    server.close()


@pytest.mark.slow
def test_smoke_preset_end_to_end_with_hub_push(tmp_path, fake_hub):
    out = tmp_path / "smoke"
    env = {"HF_ENDPOINT": fake_hub.url, "HF_TOKEN": fake_hub.token, "HF_HOME": str(tmp_path / "hf_home")}
    # the preset as the README runs it, shortened (the full preset is 400 steps)
    proc = run_cli(["--preset", "smoke", "--max-steps", "24", "--eval-every", "12", "--save-every", "12",
                    "--output-dir", str(out), "--push-to-hub", "tester/nsa-smoke"], env=env, timeout=600)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["step"] == 24 and "sample:" in proc.stdout
    # transformers' bars (each export's "Writing model shards", each load's "Loading weights") off a terminal
    assert "Writing model shards" not in proc.stdout + proc.stderr and "Loading weights" not in proc.stderr
    record = json.loads((out / "run.json").read_text())
    assert record["config"]["tokenizer"] == "byt5" and record["config"]["dataset"] == "python-docs"
    assert (out / "logs").is_dir() and list((out / "logs").rglob("events.out.tfevents*"))  # TensorBoard

    # the rendered model card carries this run's figures
    card = (out / "final" / "README.md").read_text()
    assert "${" not in card
    assert summary["val_step"] == 24
    assert f"| validation loss, latest evaluation (at step 24) | {summary['val_loss']:.4f} |" in card
    assert f"| validation perplexity, same evaluation | {summary['val_ppl']:.2f} |" in card
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in line][-1]
    assert f"| 64-127 | {last['val_loss_pos64to128']:.4f} |" in card  # (smoke: window 64, rows of 128)
    assert "| optimizer steps | 24 |" in card and f"| tokens seen | {summary['tokens_seen']:,} |" in card
    assert f"{summary['tok_s']:,.0f}" in card

    # the Hub stand-in received exactly the exported files, token checked and repo created before training
    paths = [p for _, p in fake_hub.requests]
    first_upload = next(i for i, p in enumerate(paths) if "/preupload/" in p)
    assert paths.index("/api/whoami-v2") < paths.index("/api/repos/create") < first_upload
    assert "tester/nsa-smoke" in fake_hub.repos
    assert len(fake_hub.commits) == 1 and fake_hub.commits[0]["message"] == "final"
    pushed = fake_hub.commits[0]["files"]
    local = {p.name: p.read_bytes() for p in (out / "final").iterdir() if p.is_file()}
    assert pushed == local
    assert {"config.json", "model.safetensors", "modeling_nsa.py", "configuration_nsa.py", "README.md",
            "generation_config.json", "tokenizer_config.json"} <= set(pushed)  # fmt: skip

    # a fresh process, with neither this repository nor its packages importable, loads and generates
    load = textwrap.dedent(f"""
        import sys
        sys.path = [p for p in sys.path if p.rstrip("/") != {str(Path(__file__).resolve().parents[1])!r}]
        sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__ and "editable" not in str(f)]
        import importlib.util
        assert importlib.util.find_spec("modeling_nsa") is None and importlib.util.find_spec("nsa_train") is None
        from transformers import AutoModelForCausalLM, AutoTokenizer
        path = {str(out / "final")!r}
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        ids = tok("The Python ", return_tensors="pt", add_special_tokens=False).input_ids
        gen = model.generate(ids, max_new_tokens=12)
        assert gen.shape[1] == ids.shape[1] + 12, gen.shape
        print("GENERATED", type(model).__name__, repr(tok.decode(gen[0])))
        # batched prompts: the exported tokenizer pads on the left, so every row continues from its own last token
        batch = tok(["The Python ", "A"], return_tensors="pt", padding=True, add_special_tokens=False)
        assert tok.padding_side == "left" and batch.input_ids[1, 0] == tok.pad_token_id, batch
        gen = model.generate(**batch, max_new_tokens=4)
        assert gen.shape == (2, batch.input_ids.shape[1] + 4), gen.shape
        # the model card's snippet, as written (with the local path for the repo id): no EOS after the prompt
        card = open(path + "/README.md").read()
        snippet = card.split("```python\\n", 1)[1].split("```", 1)[0].replace("tester/nsa-smoke", path)
        namespace = {{}}
        exec(snippet, namespace)
        assert namespace["inputs"].input_ids[0, -1] != tok.eos_token_id, namespace["inputs"]
        # the pipeline as the README and the card call it: the prompt's own bytes, no end-of-text after them
        from transformers import pipeline
        generator = pipeline("text-generation", model=path, trust_remote_code=True)
        out = generator("The Python ", min_new_tokens=2, max_new_tokens=2, do_sample=False, add_special_tokens=False,
                        return_tensors=True)
        prompt = tok("The Python ", add_special_tokens=False).input_ids
        ids = list(out[0]["generated_token_ids"])
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 2, (ids, prompt)
    """)
    proc = subprocess.run([sys.executable, "-c", load], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "GENERATED NSAForCausalLM" in proc.stdout


def test_wheel_ships_the_model_card_template(tmp_path):
    """A non-editable install (the built wheel, unpacked) holds the model card template and renders it from there."""
    import shutil
    import zipfile

    src = tmp_path / "src"  # the package's sources only (a build writes build/ and *.egg-info next to them)
    for name in ("modeling_nsa", "nsa_train", "model_cards"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "train_accelerate.py"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("nsa_transformers-*.whl")
    assert "nsa_train/model_cards/nsa_model_card.md" in zipfile.ZipFile(wheel).namelist()
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    render = textwrap.dedent("""
        from string import Template
        import nsa_train.model_card as mc
        print(mc.__file__)
        names = Template(mc.TEMPLATE.read_text()).get_identifiers()
        assert "${" not in mc.render({k: "x" for k in names}) and len(names) > 30
    """)
    proc = subprocess.run([sys.executable, "-c", render], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(str(tmp_path / "site" / "nsa_train")), proc.stdout


def test_hub_preflight_rejects_bad_token(fake_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr("huggingface_hub.hf_api.constants.ENDPOINT", fake_hub.url)
    with pytest.raises(hub.HubError, match="token was rejected"):
        hub.preflight("tester/repo", token="hf_wrong")
    api, url = hub.preflight("tester/repo", token=fake_hub.token)
    assert "tester/repo" in fake_hub.repos and url.endswith("/tester/repo")


def test_hub_preflight_without_network(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(hub.HubError, match="cannot reach"):
        hub.preflight("tester/repo", token="hf_any")


def test_hub_preflight_without_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(hub.HubError, match="no Hugging Face token.*hf auth login"):
        hub.preflight("tester/repo")


def test_intermediate_push_to_branch(fake_hub, monkeypatch, tmp_path):
    """`--hub-intermediate branch`: each save goes to its own branch (create_branch + commit on that revision)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr("huggingface_hub.hf_api.constants.ENDPOINT", fake_hub.url)
    api, _ = hub.preflight("tester/repo", token=fake_hub.token)
    calls = []
    monkeypatch.setattr(api, "create_branch", lambda repo_id, branch, exist_ok: calls.append((repo_id, branch)))
    (tmp_path / "w.txt").write_text("weights")
    hub.push_folder(api, "tester/repo", tmp_path, "step 10", branch="step-10")
    assert calls == [("tester/repo", "step-10")]
    assert fake_hub.commits[-1]["revision"] == "step-10" and fake_hub.commits[-1]["files"] == {"w.txt": b"weights"}
