"""The end product of a run: `<output_dir>/final`, a Hugging Face checkpoint of the weights as they are with its
model card, uploaded when the run pushes to the Hub; and a greedy sample from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import hub
from .checkpoint import export_hf_checkpoint
from .model_card import run_card_fields, write_model_card
from .run_state import RunState


@dataclass
class Exporter:
    """Writes final/ (main process) and pushes it with `hub_api`; every process calls `export` and waits for it."""

    cfg: Any  # the run's TrainConfig
    accelerator: Any
    tokenizer: Any
    out_dir: Path
    card_facts: dict  # what the card says about the run that does not change as it trains (model_card.run_card_fields)
    hub_api: Any = None  # from hub.preflight_on_main: None when the run does not push (and on every other process)

    def export(self, model, run: RunState, message: str = "", branch: str | None = None) -> Path:
        """final/ as of `run`; pushed as one commit (`message`) on `branch` (default: main). Returns its path."""
        final = Path(self.out_dir) / "final"
        if self.accelerator.is_main_process:
            model = self.accelerator.unwrap_model(model)
            export_hf_checkpoint(model, self.tokenizer, final)
            write_model_card(final, run_card_fields(self.cfg, model.config, run, out_dir=self.out_dir, **self.card_facts))
            if self.hub_api is not None:
                hub.push_folder(self.hub_api, self.cfg.push_to_hub, final, message, branch=branch)
                self.accelerator.print(f"pushed {final} to {self.cfg.push_to_hub} ({branch or 'main'}): {message}")
        self.accelerator.wait_for_everyone()
        return final


def generate_sample(model, tokenizer, prompt: str, accelerator, max_new_tokens: int = 48) -> str:
    """A greedy continuation of `prompt` by the (unwrapped) model, decoded with the prompt."""
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(accelerator.device)
    with torch.no_grad(), accelerator.autocast():
        generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(generated[0])
