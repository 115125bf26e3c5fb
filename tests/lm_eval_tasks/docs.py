"""Loads this folder's JSONL documents for the lm-eval tasks beside it (``custom_dataset``):
read from disk, so the tasks need neither the hub nor the ``datasets`` cache."""

from __future__ import annotations

import json
import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def _split(name: str) -> datasets.DatasetDict:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def code_choice(**_metadata) -> datasets.DatasetDict:
    return _split("code_choice.jsonl")


def code_until(**_metadata) -> datasets.DatasetDict:
    return _split("code_until.jsonl")
