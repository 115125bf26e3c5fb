"""The jitted engine step and prefill lower for ROCm and CUDA from this CPU machine.

The kernels inside the step are forced onto their compiled Triton path, with the block
sizes of a GPU of that platform (``compiled_kernels(target=)``), so the exported module
carries the same Triton custom calls an MI300X / MI355X or an NVIDIA GPU would compile.
"""

import pytest

from eagle_jax.engine import Engine, EngineConfig
from eagle_jax.kernels._common import TRITON_CUSTOM_CALL
from eagle_jax.testutil.export import export as _export


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target

    root = tmp_path_factory.mktemp("export")
    target = write_tiny_target(str(root / "t"), "llama", vocab_size=320)
    return target, write_tiny_eagle3_draft(str(root / "d"), target, draft_vocab_size=200)


def _engine(checkpoints, **kw):
    target, draft = checkpoints
    return Engine(EngineConfig(
        model=target, draft_model=draft, speculative_algorithm="EAGLE3", num_steps=3,
        draft_sample_method="probabilistic", dtype="bfloat16", max_model_len=64, max_num_seqs=4,
        batch_buckets=(4,), prefill_buckets=(16,), compilation_cache_dir="", precompile=False,
        **kw))


@pytest.fixture(scope="module")
def engine(checkpoints):
    return _engine(checkpoints)


def _export_step(engine, platform, target, **kw):
    """The bucket-4 step (``step_function`` keywords ``kw``), exported."""
    return _export(engine.runner.step_function(4, **kw), engine.runner.step_inputs(), (2,), platform,
                   target)


@pytest.mark.parametrize("platform, target", [("rocm", "gfx950"), ("cuda", "sm_90")])
def test_spec_step_exports_with_triton_kernels(engine, platform, target):
    exported = _export_step(engine, platform, target)
    text = exported.mlir_module()
    # proposal x S (3), sampler (2 calls), fused norm-concat (S-1 draft steps + extend),
    # gathered LM head (extend): every kernel of the step is a Triton call.
    calls = text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}")
    assert calls >= 3 + 2 + 3 + 1, calls
    assert exported.platforms == (platform,)


@pytest.mark.parametrize("platform, target", [("rocm", "gfx950"), ("cuda", "sm_90")])
def test_tree_step_exports_with_triton_kernels(checkpoints, platform, target):
    engine = _engine(checkpoints, speculative_eagle_topk=4, num_draft_tokens=16,
                     tree_verify="traversal")
    text = _export_step(engine, platform, target).mlir_module()
    # Paged attention (draft levels 2..S, verify, extend), fused norm-concat (each draft
    # forward), tree mask, the traversal sampler and its greedy rows' argmax walk
    # (``tree_sampler``, the other rules' kernel), gathered LM head (extend).
    calls = text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}")
    assert calls >= 2 + 1 + 3 + 1 + 2 + 1, calls
    for name in ("tree_mask", "traversal_sampler", "tree_sampler"):
        assert name in text, name


@pytest.fixture(scope="module")
def adaptive_engine(checkpoints):
    return _engine(checkpoints, speculative_policy="adaptive", draft_lengths=(0, 3))


@pytest.mark.parametrize("platform, target", [("rocm", "gfx950"), ("cuda", "sm_90")])
def test_length_zero_step_and_draft_catch_up_export(adaptive_engine, platform, target):
    """The adaptive policy's step of draft length 0 (the target alone) and the draft's
    catch-up over the positions it skipped."""
    engine = adaptive_engine
    text = _export_step(engine, platform, target, draft_length=0).mlir_module()
    # The target's paged attention; no draft kernel.
    assert "paged_attention" in text
    assert "rmsnorm_concat" not in text and "draft_proposal" not in text
    text = _export(engine.runner.catch_up_function(4), (engine.runner.step_inputs()[1], engine.state), (1,),
                   platform, target).mlir_module()
    # Fused norm-concat, paged attention and the gathered LM head of the draft's extend.
    assert text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") >= 3
    for name in ("rmsnorm_concat", "paged_attention", "gathered_lm_head"):
        assert name in text, name


@pytest.mark.parametrize("platform, target", [("rocm", "gfx950"), ("cuda", "sm_90")])
def test_prefill_exports_with_triton_kernels(engine, platform, target):
    """The prefill of two 16-position chunks: the target's forward, the first tokens'
    sampling and the draft's extend."""
    text = _export(engine.runner.prefill_function(), engine.runner.prefill_inputs(2, 16), (2,), platform,
                   target).mlir_module()
    for name in ("paged_attention", "rmsnorm_concat", "gathered_lm_head"):
        assert name in text, name


@pytest.fixture(scope="module")
def fp8_engine(checkpoints):
    return _engine(checkpoints, quantization="fp8")


@pytest.mark.parametrize("target, fp8, mlir", [("gfx950", "float8_e4m3fn", "f8E4M3FN>"),
                                              ("gfx942", "float8_e4m3fnuz", "f8E4M3FNUZ>")])
def test_fp8_step_exports_for_rocm(fp8_engine, target, fp8, mlir):
    """The step over an FP8 target (``quantization="fp8"``), its weights in the format
    of that GPU (e4m3fnuz on gfx942, the CPU engine's e4m3fn otherwise): the module's
    projections are XLA FP8 dots on operands of that format, beside the Triton kernels."""
    import jax

    engine = fp8_engine
    args = list(engine.runner.step_inputs())
    args[0] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, fp8) if x.dtype.itemsize == 1 and
        x.dtype.kind == "V" else x, args[0])
    text = _export(engine.runner.step_function(4), tuple(args), (2,), "rocm",
                   target).mlir_module()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [line for line in dots if mlir in line]
    # q/k/v, o, gate/up and down in the layer function (models.decoder.run_layers) that
    # each of the 4 layers of the verify forward calls.
    assert len(fp8_dots) >= 4, len(fp8_dots)
    assert text.count("call @_shared_layer(") >= 4
    other = "f8E4M3FNUZ>" if mlir == "f8E4M3FN>" else "f8E4M3FN>"
    assert not any(other in line for line in dots)
    assert text.count(f"stablehlo.custom_call @{TRITON_CUSTOM_CALL}") >= 3 + 2 + 3 + 1


def test_the_shared_layer_function_is_traced_per_kernel_lowering(engine):
    """Every decoder layer calls one jitted layer function whose traces JAX caches
    (models.decoder.run_layers): a trace made for the CPU's interpreted kernels must not
    serve a Triton export (nor one for gfx950 an export for sm_90), and the CPU run
    after an export still interprets. The step runs on the CPU, exports for two
    targets, and runs again."""
    import jax
    import numpy as np

    def run_step():
        runner = engine.runner
        runner.state, out = runner.executables[runner.menu.ready_set()[0]](
            *runner.step_inputs())
        return jax.device_get(out.num_tokens)

    np.testing.assert_array_equal(run_step(), 0)  # every row inactive: nothing committed
    counts = {}
    for platform, target in (("rocm", "gfx950"), ("cuda", "sm_90")):
        text = _export_step(engine, platform, target).mlir_module()
        layer = text[text.index("func.func private @_shared_layer"):]
        layer = layer[:layer.index("\n  }")]
        assert "paged_attention" in layer and TRITON_CUSTOM_CALL in layer, target
        counts[target] = layer
    assert counts["gfx950"] != counts["sm_90"]  # each tuned for its own GPU
    np.testing.assert_array_equal(run_step(), 0)
