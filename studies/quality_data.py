"""The quality study's text: every kind's records split once (``prepare``), and the records as the experts saw them."""

from __future__ import annotations

import json
from pathlib import Path

from studies import real_data as rd
from studies.common import log
from studies.quality_setup import AS_TRAINED, MIX


def prepare(args, tokenizer) -> None:
    """Split every kind's documents into train/cal/test records and write them (and the broad mix) under --data."""
    sizes = rd.SplitSizes(train=args.train_records, cal=args.cal_records, test=args.test_records,
                          train_per_document=args.train_per_document or None)
    splits = {}
    for kind in rd.KINDS:
        docs = rd.documents(kind, prose_dir=args.prose_dir if kind == "prose" else None)
        splits[kind] = rd.split_records(docs, tokenizer, sizes, args.record_tokens, args.seed)
        splits[kind]["prompts"] = rd.prompt_records(splits[kind]["cal"], tokenizer, args.prompt_tokens)
        for split, records in splits[kind].items():
            rd.write_jsonl(records, args.data / kind / f"{split}.jsonl")
        log(f"{args.data / kind}: " + ", ".join(f"{s} {len(r)}" for s, r in splits[kind].items()))
    for split, total in (("train", args.train_records), ("cal", args.cal_records), ("prompts", args.cal_records)):
        rd.write_jsonl(rd.interleave([splits[k][split] for k in rd.KINDS], total), args.data / MIX / f"{split}.jsonl")
    meta = {k: v for k, v in vars(args).items() if k not in ("command",)}
    (args.data / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def records_as_trained(data: Path, tokenizer) -> None:
    """Beside each kind's cal and prompt records, the same records beginning with the BOS token (``-bos``).

    The experts are fine-tuned and scored on BOS + text (``real_models.encode``), but this tokenizer adds no BOS of
    its own, so the product would calibrate on text the experts never saw without it (no attention sink at position
    0). Its text form tokenises to exactly BOS + the record's tokens.
    """
    bos = tokenizer.bos_token if tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] != [tokenizer.bos_token_id] else ""
    for kind in (*rd.KINDS, MIX):
        for split, key in (("cal", "text"), ("prompts", "prompt")):
            source = data / kind / f"{split}.jsonl"
            if source.exists():
                rd.write_jsonl([{**r, key: bos + r[key]} for r in rd.read_jsonl(source)], data / kind / f"{split}{AS_TRAINED}.jsonl")
