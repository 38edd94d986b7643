"""Held-out NLL per domain and KL(owner expert ‖ model), on any device, with the owners' predictions cached."""

from __future__ import annotations

from pathlib import Path

import torch

from studies.real_data import KINDS, read_jsonl
from studies.common import mean_nll
from studies.real_models import encode, log_probs, record_nlls, token_kl


def load(path: Path, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def nlls(records: dict[str, list]) -> dict[str, float]:
    return {k: mean_nll(r) for k, r in records.items()}


class Evaluator:
    """Scores models on every domain's test split; the owners' log-probabilities are computed once per domain."""

    def __init__(self, data: Path, tokenizer, device: str, test_records: int, kl_records: int,
                 characters: int | None = None):
        self.tokenizer, self.device = tokenizer, device
        self.tests = {k: [r["text"][:characters] for r in read_jsonl(data / k / "test.jsonl")][:test_records]
                      for k in KINDS}
        self.kl_texts = {k: texts[:kl_records] for k, texts in self.tests.items()}
        self._references: dict[tuple[str, str], list] = {}

    @torch.no_grad()
    def records(self, model) -> dict[str, list[tuple[float, int]]]:
        """Per domain, each test record's (summed NLL, tokens): what a bootstrap over the records resamples."""
        return {k: record_nlls(model, [(ids, 1) for ids in encode(self.tokenizer, texts)], self.tokenizer.pad_token_id,
                               device=self.device) for k, texts in self.tests.items()}

    def nll(self, model) -> dict[str, float]:
        """Per domain, the token-weighted mean NLL of the test records."""
        return nlls(self.records(model))

    @torch.no_grad()
    def reference(self, owner: str, owner_dir: Path, domain: str) -> list:
        key = (owner, domain)
        if key not in self._references:
            model = load(owner_dir, self.device)
            self._references[key] = log_probs(model, self.tokenizer, self.kl_texts[domain], device=self.device)
            del model
        return self._references[key]

    @torch.no_grad()
    def kl(self, model, reference: list, domain: str) -> float:
        """Token-mean KL(owner ‖ model) on the domain's first test records."""
        total, count = 0.0, 0
        for (ref, mask), (logp, _) in zip(reference, log_probs(model, self.tokenizer, self.kl_texts[domain],
                                                               device=self.device)):
            kl, n = token_kl(ref, logp, mask)
            total, count = total + kl, count + n
        return total / count


def workdir_evaluator(work: Path, tokenizer, test_records: int = 48) -> Evaluator:
    """The all-gap studies' scorer: a workdir's test split on the CPU, 16 records for the KL."""
    return Evaluator(work / "data", tokenizer, "cpu", test_records, 16)
