"""Build the Python-source corpus of the embedded default model pair.

    STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    eagle-jax build-corpus --roots "$STDLIB" --out corpus --vocab-size 8192 \\
        --heldout-every 20

Collects every ``*.py`` file under the roots (site-packages / dist-packages /
__pycache__ skipped, files over 200 KB or not UTF-8 skipped; the standard library's own
``test`` package is kept: it is ordinary Python code and roughly doubles the corpus),
splits BY FILE (held out iff int(sha1(relative path)[:8], 16) % heldout_every == 0),
trains a byte-level BPE on the train files only and writes:

    tokenizer.json, tokenizer_config.json   the tokenizer (<|endoftext|> = id 0 = EOS = BOS)
    train.npy, heldout.npy                  uint16 ids, files separated by <|endoftext|>
    train_files.txt, heldout_files.txt      the split
    corpus.json                             counts, token totals, skipped files
"""

from __future__ import annotations

import argparse
import json
import time

from eagle_jax.train.corpus import build_corpus


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--roots", nargs="+", required=True, help="directories to collect *.py from")
    p.add_argument("--out", required=True, help="corpus directory to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--heldout-every", type=int, default=20)
    p.add_argument("--max-file-bytes", type=int, default=200_000)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    t0 = time.time()
    info = build_corpus(a.roots, a.out, vocab_size=a.vocab_size, heldout_every=a.heldout_every,
                        max_file_bytes=a.max_file_bytes, progress=not a.no_progress)
    summary = {k: v for k, v in info.items() if k != "skipped"}
    summary["skipped"] = len(info["skipped"])
    summary["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary, indent=2))
    return 0

