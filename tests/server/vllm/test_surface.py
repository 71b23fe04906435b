"""The contract test of the vLLM boundary (issue 24, item 3): every entry of
``server/vllm/surface.py``'s table holds in the installed vLLM.

Three ways: the ``ast`` check the engine runs at start and ``scripts/check_vllm.py`` runs on a
wheel; the same symbols resolved on the imported modules, with their signatures; and the
behaviours the patches rely on where a unit test can see them. The checker itself is checked on
a made-up vLLM source tree (a moved module, a renamed method, a dropped parameter, inheritance
through an import).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap

import pytest
import torch

from tests.helpers.engines import requires_vllm
from vllm_deltasync import failpoints
from vllm_deltasync.server import surface_check
from vllm_deltasync.server.surface_check import check
from vllm_deltasync.server.vllm.surface import SURFACE, Symbol


@requires_vllm
def test_every_symbol_holds_in_the_installed_vllm() -> None:
    bad = [f"{f.symbol.name}: {f.problem}" for f in check() if not f.ok]
    assert not bad, "the installed vLLM differs from server/vllm/surface.py:\n" + "\n".join(bad)


def _resolve(symbol: Symbol) -> object:
    obj: object = importlib.import_module(symbol.module)
    for part in symbol.qualname.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


@requires_vllm
def test_every_symbol_resolves_on_the_imported_modules() -> None:
    for symbol in SURFACE:
        if symbol.attr:
            continue  # an instance attribute: found in the source by the ast check above
        obj = _resolve(symbol)
        if isinstance(obj, property):
            obj = obj.fget
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if symbol.params:
            params = inspect.signature(obj).parameters  # type: ignore[arg-type]
            assert all(p in params for p in symbol.params), (symbol.name, list(params))


@requires_vllm
def test_the_behaviours_the_patches_rely_on() -> None:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.engine import EngineCoreRequestType

    # the CPU GEMM patch packs through vLLM's own dispatch on a stand-in, remove_weight False:
    # the kernel lands on the object's cpu_linear and the weight it was given stays. The
    # reference is computed from copies of what vLLM was given: vLLM may convert the layer's
    # state in place (its sgl path, on AMX hosts, makes the bias float32)
    layer = torch.nn.Linear(64, 32, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    dispatch_cpu_unquantized_gemm(layer, False)
    assert callable(layer.cpu_linear) and torch.equal(layer.weight, weight)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = layer.cpu_linear(x.clone(), layer.weight, layer.bias)
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, weight, bias).float(),
                               rtol=2e-2, atol=2e-2)
    # the coordinator's hold and drain order the pause states this way
    assert PauseState.UNPAUSED < PauseState.PAUSED_NEW < PauseState.PAUSED_ALL
    # the tick is a WAKEUP our hook handles; a client's call is a UTILITY
    assert EngineCoreRequestType.WAKEUP != EngineCoreRequestType.UTILITY
    # the CPU GEMM patch reads the config being loaded; outside a load there is none
    assert get_current_vllm_config_or_none() is None
    # the quiet reads bound a sleeping reader's wait through wait(timeout_ms=...)
    assert "timeout_ms" in inspect.signature(SpinCondition.wait).parameters


def _tree(files: dict[str, str]) -> surface_check.SourceReader:
    def read(module: str) -> tuple[str, bool] | None:
        if module + ".__init__" in files:
            return textwrap.dedent(files[module + ".__init__"]), True
        if module in files:
            return textwrap.dedent(files[module]), False
        return None

    return read


def test_the_checker_finds_what_moved() -> None:
    read = _tree({
        "vllm.__init__": "",
        "vllm.base": """
            class Base:
                def __init__(self):
                    self.scheduler = None
                def run(self, request_type, request):
                    pass
        """,
        "vllm.core": """
            from vllm.base import Base
            from .sub import Helper as Renamed
            class Core(Base):
                def step(self, *, force_attention=False):
                    pass
        """,
        "vllm.sub": "class Helper:\n    KIND = 1\n",
    })
    symbols = [
        Symbol("vllm.core:Core.run", "called", "w", "x", params=("request",)),  # inherited
        Symbol("vllm.core:Core.scheduler", "read", "w", "x", attr=True),  # base's __init__
        Symbol("vllm.core:Renamed.KIND", "read", "w", "x"),  # through a relative import
        Symbol("vllm.core:Core.step", "called", "w", "x", params=("force_attention",)),
        Symbol("vllm.core:Core.step", "called", "w", "x", params=("num_tokens",)),
        Symbol("vllm.core:Core.gone", "called", "w", "x"),
        Symbol("vllm.moved:Core", "called", "w", "x"),
        Symbol("vllm.core:Core.scheduler", "read", "w", "x"),  # not a class attribute
    ]
    found = check(read, symbols)
    assert [f.ok for f in found] == [True, True, True, True, False, False, False, False], found
    assert "num_tokens" in found[4].problem
    assert "gone" in found[5].problem and "vllm.moved" in found[6].problem


def test_the_break_failpoint_names_the_symbol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(failpoints.VARIABLE, failpoints.spec("surface_break", SURFACE[3].name))
    found = check(_tree({}), SURFACE[:5])
    assert [f.problem.startswith("made to fail") for f in found] == [False] * 3 + [True, False]


def test_a_drafter_symbol_refuses_only_the_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing symbol the drafter's following needs (``scope="drafter"``) is a problem of the
    drafter only: the engine's refusal does not name it, the drafter's does."""
    drafter = [s for s in SURFACE if s.scope == "drafter"]
    assert drafter and all(s.scope in ("engine", "lora") for s in SURFACE if s not in drafter)
    monkeypatch.setenv(failpoints.VARIABLE, failpoints.spec("surface_break", drafter[0].name))
    assert not any(drafter[0].name in line for line in surface_check.cached_problems())
    assert any(drafter[0].name in line for line in surface_check.cached_problems("drafter"))
    monkeypatch.setenv(failpoints.VARIABLE, failpoints.spec("surface_break", SURFACE[0].name))
    assert not any(SURFACE[0].name in line for line in surface_check.cached_problems("drafter"))
    assert any(SURFACE[0].name in line for line in surface_check.cached_problems())


def test_a_lora_symbol_refuses_only_the_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing symbol the LoRA adapters' following needs (``scope="lora"``) refuses the
    adapters only: neither the engine's refusal nor the drafter's names it."""
    lora = [s for s in SURFACE if s.scope == "lora"]
    assert lora
    monkeypatch.setenv(failpoints.VARIABLE, failpoints.spec("surface_break", lora[0].name))
    assert any(lora[0].name in line for line in surface_check.cached_problems("lora"))
    assert not any(lora[0].name in line for line in surface_check.cached_problems())
    assert not any(lora[0].name in line for line in surface_check.cached_problems("drafter"))
