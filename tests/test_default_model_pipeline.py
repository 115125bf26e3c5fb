"""The default-model pipeline at toy size: build_corpus (split rule, tokenizer, pre-tokenised
arrays), train_target (training, held-out evaluation, time budget, resume, the Hugging Face
export that transformers loads with the same logits), and the pipeline utilities."""

from __future__ import annotations

import glob
import importlib
import json
import os
import shutil

import numpy as np
import pytest

from eagle_jax.train.corpus import EOS_TOKEN, is_heldout, write_ids_jsonl
from eagle_jax.train.pipeline import (
    cast_checkpoint,
    checkpoint_size_report,
    plan_draft_steps,
)

STDLIB = os.path.dirname(os.__file__)
TOY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
       "--intermediate", "64", "--seq-len", "64", "--batch-size", "4", "--lr", "1e-2",
       "--warmup", "2", "--dtype", "float32", "--eval-tokens", "2048", "--no-progress"]


def _script(name):
    return importlib.import_module({"build_corpus": "eagle_jax.train.corpus_cli",
                                    "train_target": "eagle_jax.train.target_cli"}[name])


def _stdlib_sample(n: int = 30) -> list[str]:
    """n small, UTF-8 stdlib modules (sorted names: deterministic per Python version)."""
    out = []
    for name in sorted(os.listdir(STDLIB)):
        path = os.path.join(STDLIB, name)
        if name.endswith(".py") and 2_000 < os.path.getsize(path) < 25_000:
            try:
                open(path, encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            out.append(path)
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    src = root / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    files = _stdlib_sample(30)
    for i, path in enumerate(files):  # some in sub-directories: keys are relative paths
        sub = "pkg/sub" if i % 3 == 0 else "pkg" if i % 3 == 1 else ""
        shutil.copyfile(path, src / sub / os.path.basename(path))
    (src / "big.py").write_text("x = 1\n" * 40_000)  # 240 KB: skipped
    (src / "latin1.py").write_bytes(b"# caf\xe9\nx = 1\n")  # not UTF-8: skipped
    (src / "notes.txt").write_text("not python")
    (src / "site-packages").mkdir()
    (src / "site-packages" / "vendored.py").write_text("import this\n")
    out = root / "corpus"
    _script("build_corpus").main(["--roots", str(src), "--out", str(out), "--vocab-size", "512",
                                  "--heldout-every", "4", "--no-progress"])
    return dict(root=root, src=src, out=str(out))


def _read_list(path):
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def test_split_rule_and_pretokenised_arrays(corpus):
    import tokenizers

    out = corpus["out"]
    train = _read_list(os.path.join(out, "train_files.txt"))
    held = _read_list(os.path.join(out, "heldout_files.txt"))
    expected = sorted(os.path.relpath(p, corpus["src"]) for p in
                      glob.glob(os.path.join(corpus["src"], "**", "*.py"), recursive=True)
                      if "site-packages" not in p and os.path.basename(p) not in
                      ("big.py", "latin1.py"))
    assert len(expected) == 30
    assert sorted(train + held) == expected and not set(train) & set(held)
    assert train == sorted(train) and held and len(train) > len(held)
    assert all(is_heldout(k, 4) for k in held) and not any(is_heldout(k, 4) for k in train)
    info = json.load(open(os.path.join(out, "corpus.json")))
    assert {s["path"] for s in info["skipped"]} == {"big.py", "latin1.py"}

    tok = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 512 and tok.token_to_id(EOS_TOKEN) == 0
    for name, keys in (("train.npy", train), ("heldout.npy", held)):
        arr = np.load(os.path.join(out, name))
        assert arr.dtype == np.uint16
        want = [0]
        for k in keys:  # every file exactly once, in order, EOS-separated: no held-out leak
            with open(os.path.join(corpus["src"], k), encoding="utf-8") as f:
                want += tok.encode(f.read(), add_special_tokens=False).ids + [0]
        np.testing.assert_array_equal(arr, np.asarray(want, np.uint16))
        assert info[name.replace(".npy", "_tokens")] == arr.size

    from eagle_jax.tokenizer import Tokenizer

    t = Tokenizer.from_dir(out)
    assert t.eos_token_id == 0 and t.bos_token_id == 0 and not t.add_bos_token
    text = t.apply_chat_template([{"role": "user", "content": "def f(x):"}],
                                 add_generation_prompt=True)
    assert text == EOS_TOKEN + "def f(x):"
    code = "def add(a, b):\n    return a + b\n"
    assert t.decode(t.encode(code)) == code


@pytest.fixture(scope="module")
def trained(corpus):
    train = _script("train_target").main
    root = corpus["root"]
    common = TOY + ["--corpus", corpus["out"], "--steps", "6", "--eval-every", "3",
                    "--save-every", "3", "--max-shard-bytes", "40000", "--export-best"]
    train(common + ["--out", str(root / "a")])  # uninterrupted
    train(common + ["--out", str(root / "b"), "--stop-after", "3"])  # interrupted ...
    train(common + ["--out", str(root / "b"), "--resume"])  # ... and resumed
    return dict(a=str(root / "a"), b=str(root / "b"), corpus=corpus["out"])


def test_resume_continues_from_saved_step(trained):
    from eagle_jax.checkpoint import CheckpointReader

    log_a = json.load(open(os.path.join(trained["a"], "train_log.json")))
    log_b = json.load(open(os.path.join(trained["b"], "train_log.json")))
    assert log_b["resumed_from"].endswith("step_0000003")
    assert log_a["final"]["step"] == log_b["final"]["step"] == 6
    steps_b = [r["step"] for r in log_b["records"] if "loss" in r]
    assert steps_b == sorted(steps_b) and steps_b[-1] == 6 and 3 in steps_b
    for key in ("heldout_loss", "heldout_ppl"):
        assert log_a["final"][key] is not None
        assert log_b["final"][key] == pytest.approx(log_a["final"][key], rel=1e-5)
    assert log_a["final"]["heldout_ppl"] == pytest.approx(np.exp(log_a["final"]["heldout_loss"]),
                                                           rel=1e-4)
    ra = CheckpointReader(os.path.join(trained["a"], "ckpt", "step_0000006"))
    rb = CheckpointReader(os.path.join(trained["b"], "ckpt", "step_0000006"))
    assert sorted(ra.keys()) == sorted(rb.keys())
    for name in ra.keys():  # same batches, same updates: the same parameters and moments
        np.testing.assert_allclose(np.asarray(rb.get(name), np.float64),
                                   np.asarray(ra.get(name), np.float64), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    assert len(glob.glob(os.path.join(trained["a"], "ckpt", "step_*"))) == 2  # pruned


def test_export_loads_in_transformers_with_matching_logits(trained):
    import jax.numpy as jnp
    import torch
    import transformers

    from eagle_jax.checkpoint import CheckpointReader
    from eagle_jax.models.decoder import load_decoder

    d = trained["a"]
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16" and cfg["max_position_embeddings"] == 2048
    assert cfg["rope_theta"] == 10000.0 and cfg["eos_token_id"] == 0 and cfg["vocab_size"] == 512
    assert json.load(open(os.path.join(d, "generation_config.json")))["eos_token_id"] == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert os.path.exists(os.path.join(d, f)), f
    shards = glob.glob(os.path.join(d, "*.safetensors"))
    assert len(shards) > 1 and all(os.path.getsize(s) <= 40000 + 8192 for s in shards)
    reader = CheckpointReader(d)
    assert "lm_head.weight" not in reader.keys()
    assert {str(reader.get(k).dtype) for k in reader.keys()} == {"bfloat16"}

    tokens = np.load(os.path.join(trained["corpus"], "heldout.npy"))[:48].astype(np.int64)[None]
    ours = load_decoder(d, "float32")
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits = np.asarray(ours(jnp.asarray(tokens, jnp.int32), pos,
                             ours.init_cache(1, tokens.shape[1])).logits)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens)).logits.numpy()
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.eos_token_id == 0


def test_time_budget_fits_the_schedule(corpus, tmp_path):
    rc = _script("train_target").main(
        TOY + ["--corpus", corpus["out"], "--out", str(tmp_path / "c"), "--steps", "100000",
               "--eval-every", "0", "--save-every", "0", "--time-budget-s", "1",
               "--fit-steps-to-budget"])
    log = json.load(open(tmp_path / "c" / "train_log.json"))
    assert rc == 0 and log["final"]["step"] < 100000
    assert log["final"]["stopped_by_budget"] or log["total_steps"] < 100000
    assert log["final"]["step"] <= log["total_steps"]
    assert os.path.exists(tmp_path / "c" / "config.json")


def test_pipeline_utilities(trained, tmp_path):
    # the float32 -> bfloat16 cast used for the draft; here bf16 -> f32 and back
    f32 = str(tmp_path / "f32")
    nbytes = cast_checkpoint(trained["a"], f32, "float32", max_shard_bytes=10**9)
    rep = checkpoint_size_report({"bf16": trained["a"], "f32": f32})
    assert rep["f32"]["elements"] == rep["bf16"]["elements"]
    assert rep["f32"]["tensor_bytes"] == 2 * rep["bf16"]["tensor_bytes"]
    assert rep["f32"]["file_bytes"] == nbytes
    assert json.load(open(os.path.join(f32, "config.json")))["torch_dtype"] == "float32"
    assert os.path.exists(os.path.join(f32, "tokenizer.json"))

    # train.npy -> the draft trainer's pre-tokenised JSONL
    npy = os.path.join(trained["corpus"], "train.npy")
    rows = write_ids_jsonl(npy, str(tmp_path / "d.jsonl"), row_tokens=100, max_tokens=1050)
    ids = [json.loads(line)["input_ids"] for line in open(tmp_path / "d.jsonl")]
    assert rows == 11 and [len(r) for r in ids] == [100] * 10 + [50]
    np.testing.assert_array_equal(np.concatenate(ids), np.load(npy)[:1050])

    # planning the draft run from a calibration run's metrics
    calib, data = tmp_path / "calib", tmp_path / "data"
    calib.mkdir()
    data.mkdir()
    with open(calib / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "eval_acc": [0.0]}) + "\n")
        for s, e in ((10, 30.0), (20, 31.0), (30, 32.0), (40, 33.0)):
            f.write(json.dumps({"step": s, "loss": 1.0, "elapsed_s": e}) + "\n")
    (data / "tokens_00000.npy").write_bytes(b"")
    (data / "meta.json").write_text("{}")
    t_first, t_meta = 1000.0 + 8.0, 1000.0 + 20.0
    os.utime(data / "tokens_00000.npy", (t_first, t_first))
    os.utime(data / "meta.json", (t_meta, t_meta))
    plan = plan_draft_steps(str(calib), str(data), 1000.0, 1000.0 + 60.0, 100.0,
                            max_steps=10**6, safety=1.0)
    assert plan["step_s"] == pytest.approx(0.1)
    assert plan["startup_s"] == pytest.approx(8.0) and plan["collect_s"] == pytest.approx(12.0)
    # fixed: startup 8 + (60 - 20 - 40 * 0.1) = 44 -> (100 - 44) / 0.1 = 560 steps
    assert plan["fixed_s"] == pytest.approx(44.0) and plan["steps"] == 560
