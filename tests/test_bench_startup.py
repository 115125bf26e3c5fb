"""``eagle-jax bench startup``'s compile and load measurements on a tiny target (the
server's start-up is tested in test_fast_start.py)."""

from __future__ import annotations

import json
import os

from eagle_jax.bench import startup
from eagle_jax.engine import EngineConfig


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


def test_time_to_first_token_reads_the_stream_once_and_times_its_first_token():
    """The first ``data:`` line's arrival, not the stream's end, against a local server
    that streams a token after FIRST_S and the rest after a further REST_S (the
    benchmark's server part failed on a GPU reading the stream twice: httpx's
    StreamConsumed)."""
    import http.server
    import threading
    import time

    first_s, rest_s = 0.3, 0.6

    class Streamer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(first_s)
            for line in ('data: {"choices": [{"text": "a"}]}', 'data: {"choices": []}',
                         "data: [DONE]"):
                self.wfile.write((line + "\n\n").encode())
                self.wfile.flush()
                time.sleep(rest_s / 3)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Streamer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.perf_counter()
        ttft_ms = startup.time_to_first_token(f"http://127.0.0.1:{server.server_port}")
        total_s = time.perf_counter() - t0
    finally:
        server.shutdown()
    assert first_s * 1e3 <= ttft_ms < (first_s + rest_s / 3) * 1e3, ttft_ms
    assert total_s >= first_s + rest_s * 0.9  # the rest of the stream was read to its end


def test_compile_table_of_an_adaptive_speculative_engine(models, capsys):
    """The adaptive draft policy compiles and times every step variant as the engine
    starts, before the menu's loop (the benchmark failed so on a GPU: it took each
    compile to be the loop's current key): each executable is timed once, under its
    own key, in the menu's order."""
    times = startup.time_compiles(EngineConfig(
        model=models["target"], draft_model=models["eagle3"], speculative_algorithm="EAGLE3",
        num_steps=1, speculative_policy="adaptive", draft_lengths=(0, 1), dtype="float32",
        max_model_len=64, max_num_seqs=1, batch_buckets=(1,), prefill_buckets=(16,)))
    families = [t.family for t in times]
    assert {"step, draft length 0", "step, draft length 1", "catch up"} <= set(families)
    assert len({t.key for t in times}) == len(times)
    printed = capsys.readouterr().out
    for t in times:
        assert printed.count(t.key + ":") == 1, t.key
        assert t.trace_s > 0 and t.lower_s > 0 and t.compile_s > 0, t
