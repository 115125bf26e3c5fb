"""scripts/evaluate.py on a tiny target + EAGLE-3 draft: its JSON report must match an
independent count from the engine's own statistics over the same workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.eval import evaluate as ev
from eagle_jax.eval.dataset import load_dataset
from eagle_jax.sampling import SamplingParams

from .multidevice import FAST_COMPILE_FLAGS

ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=3, batch_buckets=(3,),
              prefill_buckets=(32,), compilation_cache_dir="")
PROMPTS = [
    ("The quick brown fox", " jumps over the lazy dog."),
    ("def fibonacci(n: int) -> list[int]:", None),
    ("Once upon a time there was", " a little server"),
    ("In the morning the weather was cold", None),
    ("for index in range(10):", "\n    if index % 2 == 0:"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Tiny Llama target (embedding width 320) with a 300-token test tokenizer, and a
    random EAGLE-3 draft; a JSONL dataset with text prompts, some with references."""
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    root = tmp_path_factory.mktemp("evaluate")
    target = write_tiny_target(str(root / "target"), "llama", vocab_size=320, hidden_size=32,
                               num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64,
                               max_position_embeddings=128, eos_token_id=2, init_std=0.05)
    write_test_tokenizer(target, vocab_size=300)
    draft = write_tiny_eagle3_draft(str(root / "draft"), target, init_std=0.05)
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for prompt, ref in PROMPTS:
            rec = {"prompt": prompt}
            if ref is not None:
                rec["reference"] = ref
            f.write(json.dumps(rec) + "\n")
    return dict(root=root, target=target, draft=draft, data=str(data))


def _independent_stats(pair, temperature: float, max_tokens: int, batch: int, seed: int):
    """The same workload on a plain Engine: batches of `batch` prompts, request i seeded
    with seed + i, stepped to completion; returns engine.stats and the outputs."""
    eng = Engine(EngineConfig(model=pair["target"], draft_model=pair["draft"],
                              speculative_algorithm="EAGLE3", num_steps=2,
                              draft_sample_method="probabilistic", seed=seed, **ENGINE))
    exs = load_dataset(pair["data"], eng.tokenizer)
    outs = {}
    for start in range(0, len(exs), batch):
        for j, e in enumerate(exs[start:start + batch]):
            rid = f"r{start + j}"
            eng.add_request(rid, e.prompt_ids, SamplingParams(
                temperature=temperature, seed=seed + start + j, max_tokens=max_tokens))
            outs[rid] = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
    return eng.stats, [outs[f"r{i}"] for i in range(len(exs))]


def test_evaluate_report_matches_engine_counts(pair, tmp_path):
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    rc = ev.main([
        "--model", pair["target"], "--draft-model", pair["draft"], "--dataset", pair["data"],
        "--num-steps", "2", "--temperature", "0,1", "--draft-sample-method", "probabilistic",
        "--batch-size", "3", "--batch-buckets", "3", "--prefill-buckets", "32",
        "--max-model-len", "64", "--max-tokens", "12", "--seed", "7",
        "--compilation-cache-dir", "", "--json", str(out), "--plot", str(plots),
        "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["algorithm"] == "EAGLE3"  # detected from the draft checkpoint
    assert rep["dataset"]["num_examples"] == 5 and rep["dataset"]["num_with_reference"] == 3
    assert [b["temperature"] for b in rep["baseline"]] == [0.0, 1.0]
    assert [r["label"] for r in rep["runs"]] == ["S=2 T=0 probabilistic",
                                                 "S=2 T=1 probabilistic"]

    stats, sampled_outputs = _independent_stats(pair, 1.0, 12, 3, 7)
    run = rep["runs"][1]
    # Accept counts: the report's per-step figures equal the engine's own counters.
    assert run["num_drafts"] == stats.num_drafts > 0
    assert run["num_draft_tokens"] == stats.num_draft_tokens == 2 * stats.num_drafts
    assert run["num_accepted_tokens"] == stats.num_accepted_tokens
    assert run["accepted_per_position"] == stats.accepted_per_pos
    assert run["mean_accept_length"] == pytest.approx(stats.mean_accept_length)
    assert run["acceptance_per_position"] == pytest.approx(stats.acceptance_per_position())
    # The histogram follows from the per-position counts alone: #(accept >= k) = per_pos[k-1].
    ge = [stats.num_drafts] + list(stats.accepted_per_pos) + [0]
    assert [run["accept_length_histogram"][str(k + 1)] for k in range(3)] == [
        ge[k] - ge[k + 1] for k in range(3)]
    assert sum(run["accept_length_distribution"].values()) == pytest.approx(1.0)
    assert run["num_emitted_tokens"] == stats.num_emitted_tokens
    assert run["num_invalid_tokens"] == stats.num_invalid_tokens == 0
    assert run["num_sampler_fallbacks"] == stats.num_sampler_fallbacks
    assert run["num_malformed_draft_probs"] == stats.num_malformed_draft_probs
    assert run["stats_consistent"] is True
    assert run["num_output_tokens"] == sum(len(t) for t in sampled_outputs)
    assert [r["output_tokens"] for r in run["requests"]] == [len(t) for t in sampled_outputs]
    # A tiny random draft at T = 1 still gets some acceptance with probabilistic drafting.
    assert run["num_accepted_tokens"] > 0

    greedy = rep["runs"][0]
    assert greedy["greedy_identical"] == {"identical": 5, "total": 5}
    for r in rep["runs"]:  # a chain: K = 1, S + 1 tokens verified per step
        assert (r["topk"], r["num_verify_tokens"], r["tree_verify"]) == (1, 3, None)
    assert "tree verify" not in ev.format_table(rep)  # a sweep of chains prints as before
    assert run["greedy_identical"] is None
    for r in rep["runs"]:
        assert r["output_tokens_per_s"] > 0 and r["mean_tpot_ms"] > 0
        assert r["speedup"] > 0 and r["baseline_output_tokens_per_s"] > 0
        assert r["exact_match"]["total"] == 3
        assert r["num_stray_output_tokens"] == 0
    sc = rep["reference_scores"]
    assert sc["num_examples"] == 3 and sc["num_tokens"] > 0
    assert 0 <= sc["next_token_accuracy"] <= 1 and sc["perplexity"] > 1
    for name in ("accept_length.png", "acceptance_per_position.png",
                 "accept_length_distribution.png"):
        assert (plots / name).stat().st_size > 0


def test_evaluate_at_data_parallel_2_equals_one_engine(pair, tmp_path):
    """scripts/evaluate.py --data-parallel-size 2 (two host devices, a child process):
    EAGLE-3 under data parallelism, each batch's requests spread over the replicas. Its
    greedy run commits the same tokens as one engine (same counts per request, the same
    accept counts) and equals its own target-only baseline; the per-step records of both
    replicas add up to the summed engine counters."""
    args = ["--model", pair["target"], "--draft-model", pair["draft"],
            "--dataset", pair["data"], "--num-steps", "2", "--temperature", "0",
            "--batch-size", "3", "--batch-buckets", "3", "--prefill-buckets", "32",
            "--max-model-len", "64", "--max-tokens", "10", "--seed", "3",
            "--compilation-cache-dir", "", "--no-progress"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert ev.main(args + ["--json", str(one)]) == 0
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE_FLAGS}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.run(
        [sys.executable, "scripts/evaluate.py", *args, "--data-parallel-size", "2",
         "--json", str(two)], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    ref, got = (json.loads(p.read_text())["runs"][0] for p in (one, two))
    assert got["greedy_identical"] == {"identical": 5, "total": 5}
    assert got["stats_consistent"] is True
    for key in ("num_drafts", "num_accepted_tokens", "accepted_per_position",
                "num_output_tokens"):
        assert got[key] == ref[key], key
    per_request = lambda run: [(r["output_tokens"], r["finish_reason"], r["mean_accept_length"],
                                r["exact_match"]) for r in run["requests"]]  # noqa: E731
    assert per_request(got) == per_request(ref)


def test_directory_dataset_windows(pair, tmp_path):
    from eagle_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(pair["target"])
    (tmp_path / "src").mkdir()
    text = "def add(a, b):\n    return a + b\n\n" * 20
    (tmp_path / "src" / "b.py").write_text(text)
    (tmp_path / "src" / "a.txt").write_text("short")
    (tmp_path / "src" / ".hidden").write_text(text)
    (tmp_path / "src" / "blob.bin").write_bytes(b"\xff\xfe\x00\x81" * 50)
    ids = tok.encode(text, add_special_tokens=False)
    exs = load_dataset(str(tmp_path / "src"), tok, prompt_tokens=10, continuation_tokens=5)
    assert len(exs) == len(ids) // 15  # "short" and the hidden / binary files give none
    assert exs[1].prompt_ids == ids[15:25] and exs[1].reference_ids == ids[25:30]
    assert exs[0].source == "b.py#0"
    assert len(load_dataset(str(tmp_path / "src"), tok, prompt_tokens=10,
                            continuation_tokens=5, windows_per_file=2)) == 2


def test_missing_default_pair_exits_2(monkeypatch, tmp_path, capsys):
    import eagle_jax.eval.models as models

    monkeypatch.setattr(models, "DEFAULT_TARGET", str(tmp_path / "absent" / "target"))
    monkeypatch.setattr(models, "DEFAULT_DRAFT", str(tmp_path / "absent" / "draft"))
    assert ev.main(["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not shipped yet" in err and "--model" in err



def test_tree_settings_in_the_sweep(pair, tmp_path):
    """A tree (K = 2, depth 3, N = 6 tokens verified per step), verified by Traversal
    Verification (the engine's other real-q rule, which ``test_engine.py``'s trees do not
    take), through the sweep: the report names it and counts its accept lengths per
    depth, as for a chain of 3."""
    out = tmp_path / "report.json"
    rc = ev.main([
        "--model", pair["target"], "--draft-model", pair["draft"], "--dataset", pair["data"],
        "--num-steps", "3", "--speculative-eagle-topk", "2", "--num-draft-tokens", "6",
        "--tree-verify", "traversal",
        "--temperature", "0,1", "--batch-size", "3", "--batch-buckets", "3",
        "--prefill-buckets", "32", "--max-model-len", "64", "--max-tokens", "10",
        "--seed", "3", "--compilation-cache-dir", "", "--json", str(out), "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["speculative_eagle_topk"] == [2]
    assert rep["config"]["num_draft_tokens"] == [6]
    assert rep["config"]["tree_verify"] == ["traversal"]
    assert [r["label"] for r in rep["runs"]] == ["S=3 K=2 N=6 T=0 traversal",
                                                 "S=3 K=2 N=6 T=1 traversal"]
    for r in rep["runs"]:
        assert (r["topk"], r["num_verify_tokens"], r["tree_verify"]) == (
            2, 6, "traversal")
        assert r["draft_sample_method"] is None and r["num_steps"] == 3
        # A tree of depth 3 commits 1 .. 4 tokens per request-step, counted per depth;
        # each request-step drafted the tree's N - 1 = 5 nodes.
        assert r["num_drafts"] > 0 and r["num_draft_tokens"] == 5 * r["num_drafts"]
        assert 1.0 <= r["mean_accept_length"] <= 4.0
        acc = r["acceptance_per_position"]
        assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
        assert acc == sorted(acc, reverse=True)
        assert r["mean_accept_length"] == pytest.approx(1.0 + sum(acc))
        assert sorted(r["accept_length_histogram"]) == ["1", "2", "3", "4"]
        assert sum(r["accept_length_distribution"].values()) == pytest.approx(1.0)
        assert r["stats_consistent"] is True
        assert r["num_invalid_tokens"] == r["num_stray_output_tokens"] == 0
        assert r["engine_stats"]["draft_length_steps"][3] > 0  # every step drafts depth 3
        assert r["num_output_tokens"] > 0 and r["speedup"] > 0
    assert rep["runs"][0]["greedy_identical"] == {"identical": 5, "total": 5}
    table = ev.format_table(rep)
    assert table.splitlines()[0].split()[:5] == ["setting", "K", "N", "tree", "verify"]
    assert "S=3 K=2 N=6 T=1 traversal  2  6  traversal" in table


def test_sweep_settings():
    """Chains for each S x draft-sample method; trees for each K > 1 x tree depth x N x
    verify rule, not once per method."""
    args = ev.build_parser().parse_args([
        "--num-steps", "5", "--tree-num-steps", "6,4", "--speculative-eagle-topk", "1,4,2",
        "--num-draft-tokens", "32,16", "--tree-verify", "target_only,recursive_rejection",
        "--draft-sample-method", "greedy,probabilistic"])
    got = [st.label(1.0) for st in ev._settings(args)]
    assert got[:2] == ["S=5 T=1 greedy", "S=5 T=1 probabilistic"]
    assert got[2:6] == ["S=6 K=4 N=32 T=1 target_only", "S=6 K=4 N=32 T=1 recursive_rejection",
                        "S=6 K=4 N=16 T=1 target_only", "S=6 K=4 N=16 T=1 recursive_rejection"]
    assert len(got) == 2 + 2 * 2 * 2 * 2 and got[-1] == "S=4 K=2 N=16 T=1 recursive_rejection"
    # Defaults: chains only, S + 1 verified; a tree's N left to the engine (32), its
    # sampled rows verified by traversal.
    args = ev.build_parser().parse_args(["--speculative-eagle-topk", "1,4", "--num-steps", "6"])
    assert ev._settings(args) == [ev.Setting(6, "probabilistic"),
                                  ev.Setting(6, None, 4, None, "traversal")]
    cfg = ev._engine_config(args, "target", "draft", "EAGLE3", ev._settings(args)[1])
    assert (cfg.num_draft_tokens, cfg.speculative_policy, cfg.tree_verify) == (
        32, "fixed", "traversal")
    assert ev._settings(args)[1].label(0.0, num_verify_tokens=32) == (
        "S=6 K=4 N=32 T=0 traversal")


def test_tree_flags_checked_before_running(pair, capsys):
    # K = 2, depth 2: at most 1 + 2 + 4 = 7 tokens verified per step.
    assert ev.main(["--model", pair["target"], "--draft-model", pair["draft"],
                    "--num-steps", "2", "--speculative-eagle-topk", "2",
                    "--num-draft-tokens", "8", "--no-progress"]) == 2
    assert "num_draft_tokens 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ev.build_parser().parse_args(["--tree-verify", "sglang"])
