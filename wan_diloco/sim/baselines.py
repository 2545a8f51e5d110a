"""The baselines are settings of the same protocol (K = M is synchronous DiLoCo): the spec each one runs."""
from __future__ import annotations

from wan_diloco.spec import RunSpec


def protocol_for(spec: RunSpec) -> RunSpec:
    """``spec`` with the learner and syncer settings its ``simulate.baseline`` implies.

    - decoupled: as written (K, grace, H, P, τ from the file);
    - streaming: P fragments with overlap τ, but every learner waits for each fragment's
      update τ steps after sending it, and the syncer waits for all M (no grace);
    - diloco: the whole model every H steps, blocking, K = M;
    - dp: not a protocol setting (its own driver, ``sim.dp``); returned unchanged.
    """
    baseline, M = spec.simulate.baseline, spec.run.learners
    if baseline == "diloco":
        return spec.with_changes(learner={"num_fragments": 1, "fragment_order": [], "tau": 0, "blocking": True,
                                          "keep_local": False},
                                 syncer={"quorum": M, "grace": False})
    if baseline == "streaming":
        return spec.with_changes(learner={"blocking": True}, syncer={"quorum": M, "grace": False})
    return spec
