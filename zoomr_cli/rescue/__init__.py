"""KV-Rescue (the KV-Rescue paper): an evicted base model and a full-KV helper propose steps, a scorer commits one.

:mod:`.loop` (the step loop), :mod:`.engine` (one role's model and committed state), :mod:`.detectors`
(early abort of degenerate base candidates: zoomr's calibrated :mod:`.degeneration` or the paper's
:mod:`.paper_detector`), :mod:`.scorers` (PRM, or the helper's log-likelihood),
:mod:`.events` and :mod:`.transcript` (what happened, for views and records), :mod:`.plan` (settings resolved
before any model loads) and :mod:`.runner` (one run over loaded models). No typer/rich import.
"""
