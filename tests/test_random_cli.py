"""Random training states through ``inshrink compress`` / ``verify`` / ``info`` / ``decompress``.

The states of ``tests/policies/random_states.py`` written as ``.pt`` (the whole state) or
``.safetensors`` (the model's flat dict), compressed under a random policy, perhaps against
a base given as ``.pt`` or ``.ink`` (the state of an earlier save), verified, shown by
``info`` (its JSON names the file's size), and written back out as ``.pt`` or
``.safetensors``. What comes back, read as people read those files
(``torch.load(weights_only=True)``, ``safetensors``), keeps the promises of
``test_random_states.py``; lossless comes back exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from inshrinkerator.cli import main
from inshrinkerator.interchange import read_any
from tests.policies.dynaquant_states import one_thread  # noqa: F401  (autouse fixture)
from tests.policies.random_states import (
    BASELINES,
    LONG,
    Scenario,
    Trainer,
    fuzz_settings,
    identical,
    problems,
    scenarios,
)

pytestmark = [pytest.mark.timeout(0)] if LONG else []

POLICIES = ("lossless", "dynaquant", "dynaquant:tolerance=0.01", *BASELINES)


@dataclass(frozen=True)
class Conversion:
    scenario: Scenario
    policy: str
    source: str  # ".pt" or ".safetensors"
    target: str
    base: str  # "none", ".pt" or ".ink"


def conversions() -> st.SearchStrategy[Conversion]:
    suffixes = st.sampled_from([".pt", ".safetensors"])
    return st.builds(Conversion, scenarios(), st.sampled_from(POLICIES), suffixes, suffixes,
                     st.sampled_from(["none", ".pt", ".ink"]))


def write(state: Any, path: Path) -> None:
    if path.suffix == ".pt":
        torch.save(state, path)
        return
    from safetensors.torch import save_file

    model, seen = {}, set()
    for name, tensor in state["model"].items():  # safetensors refuses shared memory
        model[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    save_file(model, path)


@fuzz_settings(15)
@given(conversion=conversions())
def test_random_states_through_the_cli(conversion: Conversion, tmp_path_factory: Any, capsys: Any) -> None:
    folder: Path = tmp_path_factory.mktemp("cli")
    trainer = Trainer(conversion.scenario)
    states = [trainer.train(plan) for plan in conversion.scenario.saves]
    source = folder / f"in{conversion.source}"
    write(states[-1], source)
    given_state = read_any(source)
    base_args: list[str] = []
    if conversion.base != "none":
        base = folder / f"base{conversion.source}"
        write(states[0], base)
        if conversion.base == ".ink":
            assert main(["compress", str(base), str(folder / "base.ink"), "--policy", conversion.policy]) == 0
            base = folder / "base.ink"
        base_args = ["--base", str(base)]
    packed = folder / "state.ink"
    assert main(["compress", str(source), str(packed), "--policy", conversion.policy, *base_args]) == 0
    assert main(["verify", str(packed), *base_args]) == 0
    capsys.readouterr()
    assert main(["info", str(packed)]) == 0
    capsys.readouterr()
    assert main(["info", "--json", str(packed)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stored_bytes"] == packed.stat().st_size
    assert sum(tensor["stored_bytes"] for tensor in summary["tensors"]) <= summary["stored_bytes"]
    out = folder / f"out{conversion.target}"
    code = main(["decompress", str(packed), str(out), *base_args])
    if conversion.target == ".safetensors" and conversion.source == ".pt":
        assert code == 1 and not out.exists()  # a nested state: refused, with a message
        assert ".pt file instead" in capsys.readouterr().err
        return
    assert code == 0
    restored = read_any(out)
    if conversion.policy == "lossless":
        assert identical(given_state, restored)
        return
    if conversion.source == ".safetensors":  # the model's weights, to be checked as weights
        given_state, restored = {"model": given_state}, {"model": restored}
    found = problems(given_state, restored, bounded=conversion.policy.startswith("dynaquant"))
    assert found == [], found
