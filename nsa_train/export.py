"""The end product of a run: `<output_dir>/final`, a Hugging Face checkpoint of the weights as they are with its
model card, uploaded when the run pushes to the Hub; and a greedy sample from it."""

from __future__ import annotations

from pathlib import Path

import torch

from . import hub
from .checkpoint import export_hf_checkpoint
from .metrics import device_info
from .model_card import data_description, run_card_fields, write_model_card
from .run_state import RunState


class Exporter:
    """Writes final/ (main process) and pushes it with `hub_api` (from hub.preflight_on_main: None when the run does
    not push, and on every other process). Every process calls `export` and waits for it."""

    def __init__(self, cfg, accelerator, tokenizer, out_dir: Path, hub_api=None, *, n_params: int, precision: str,
                 source):  # fmt: skip
        self.cfg, self.accelerator, self.tokenizer, self.out_dir = cfg, accelerator, tokenizer, Path(out_dir)
        self.hub_api = hub_api
        # what the card says about the run that does not change as it trains
        self.card_facts = dict(n_params=n_params, world=accelerator.num_processes, mixed_precision=precision,
                               device=device_info(accelerator).get("gpu", accelerator.device.type),
                               data_description=data_description(source))  # fmt: skip

    def export(self, model, run: RunState, message: str = "", branch: str | None = None) -> Path:
        """final/ as of `run`; pushed as one commit (`message`) on `branch` (default: main). Returns its path."""
        final = self.out_dir / "final"
        state_dict = self.accelerator.get_state_dict(model)  # every process: under FSDP it gathers the shards
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(model)
            # the length it was trained at travels with the model (a copy or a Hub download has no run.json)
            model.config.training_seq_len = self.cfg.seq_len
            export_hf_checkpoint(model, self.tokenizer, final, state_dict=state_dict)
            self._card_and_push(model, run, message, branch)
        self.accelerator.wait_for_everyone()
        return final

    def update_card(self, model, run: RunState, message: str) -> None:
        """final/'s model card again, with what the run measured after the export (the long-context evaluation);
        pushed as one commit (`message`) when the run pushes."""
        if self.accelerator.is_main_process:
            self._card_and_push(self.accelerator.unwrap_model(model), run, message)
        self.accelerator.wait_for_everyone()

    def _card_and_push(self, model, run: RunState, message: str, branch: str | None = None) -> None:
        final = self.out_dir / "final"
        write_model_card(final, run_card_fields(self.cfg, model.config, run, out_dir=self.out_dir, **self.card_facts))
        if self.hub_api is not None:
            hub.push_folder(self.hub_api, self.cfg.push_to_hub, final, message, branch=branch)
            self.accelerator.print(f"pushed {final} to {self.cfg.push_to_hub} ({branch or 'main'}): {message}")


def generate_sample(model, tokenizer, prompt: str, accelerator, max_new_tokens: int = 48) -> str:
    """A greedy continuation of `prompt` by the (unwrapped) model, decoded with the prompt."""
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(generated[0])
