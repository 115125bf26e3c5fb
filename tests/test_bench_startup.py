"""``eagle-jax bench startup``'s compile and load measurements on a tiny target (the
server's start-up is tested in test_fast_start.py)."""

from __future__ import annotations

import json
import os

from eagle_jax.bench import startup


def test_compile_and_load_tables(tmp_path, capsys, tiny_targets):
    target = tiny_targets("llama", num_layers=2)
    out = tmp_path / "startup.json"
    assert startup.main(["--only", "load,compile", "--model", target,
                         "--speculative-algorithm", "NONE", "--max-num-seqs", "1",
                         "--batch-buckets", "1", "--prefill-buckets", "16",
                         "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # Every executable of the menu, once, each stage timed.
    rows = result["compile"]
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)) >= 3
    assert {"step, draft length 0", "prefill, 1 x 16", "update slots"} <= {
        row["family"] for row in rows}
    for row in rows:
        assert row["trace_s"] > 0 and row["lower_s"] > 0 and row["compile_s"] > 0, row
    printed = capsys.readouterr().out
    assert f"| all | {len(rows)} |" in printed
    # The bytes read are the checkpoint's files.
    load = result["load"]
    assert load["bytes"] == sum(os.path.getsize(os.path.join(target, f))
                                for f in os.listdir(target) if f.endswith(".safetensors"))
    assert load["disk_gb_s"] > 0 and load["load_cold_gb_s"] > 0 and load["load_warm_gb_s"] > 0
