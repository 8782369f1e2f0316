"""The trtllm engine is imported only when chosen, and without TensorRT-LLM it stops the worker
at start with one line that says what to install, before anything is written to Redis.
(Where tensorrt_llm imports, tests/test_engines_conformance.py runs the full suite on it.)"""

import importlib.util
import sys

import pytest

from conductor.client import Conductor
from conductor.redis_contract import keys as K
from conductor.workers.engines import make_engine
from conductor.workers.engines.base import EngineConfigError, EngineUnavailable
from tests.conftest import cli

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_choosing_sim_or_torch_never_imports_tensorrt_llm():
    make_engine("sim", model="m")
    make_engine("torch", model="m", model_path="tiny", device="cpu")
    assert "tensorrt_llm" not in sys.modules or HAVE_TRTLLM


def test_missing_package_is_a_clear_error(tmp_path):
    if HAVE_TRTLLM:  # installed here: the same call must then fail on the flag it names instead
        with pytest.raises(EngineConfigError, match="--model-path"):
            make_engine("trtllm", model="m", model_path=str(tmp_path / "absent"))
        return
    with pytest.raises(EngineUnavailable, match=r"engine trtllm needs TensorRT-LLM.*pip install 'tensorrt-llm==1\.2"):
        make_engine("trtllm", model="m", model_path=str(tmp_path))


def test_worker_that_cannot_build_its_engine_exits_with_one_line_and_writes_nothing(redis_url, tmp_path):
    p = cli("worker", "--engine", "trtllm", "--model", "m", "--create", "--model-path", str(tmp_path / "absent"),
            url=redis_url, check=False, timeout=60)
    err = p.stderr.decode()
    want = "conductor: --model-path" if HAVE_TRTLLM else "conductor: engine trtllm needs TensorRT-LLM"
    assert p.returncode == 2 and err.startswith(want), err
    assert "Traceback" not in err
    assert Conductor.from_url(redis_url).r.hgetall(K.ModelKeys("m").workers) == {}
    p = cli("worker", "--engine", "torch", "--model", "m", "--create", "--model-path", str(tmp_path / "absent"),
            url=redis_url, check=False, timeout=60)
    assert p.returncode == 2 and p.stderr.decode().startswith("conductor: --model-path"), p.stderr.decode()
