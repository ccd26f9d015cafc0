"""A policy knob typed for a policy that does not read it is refused (one line naming the flag and the
policies that read it), in solve, chat and solve --rescue as in bench; a knob left at its default never is.

Runs :func:`zoomr.cli.app.main` in this process: the refusal comes before any model loads.
"""

import pytest

from zoomr.cli.app import main


@pytest.mark.parametrize("args,line", [
    (["solve", "--policy", "full", "--sink", "2", "-p", "1+1"],
     "--sink is read by streaming only, not by --policy full"),
    # typed at its default value: still typed
    (["solve", "--policy", "full", "--budget", "64", "-p", "1+1"],
     "--budget is read by streaming, h2o, snapkv, rkv, keydiff, triattention only, not by --policy full"),
    (["solve", "--policy", "rkv", "--topk-per-head", "3", "-p", "1+1"],
     "--topk-per-head is read by zoomr only, not by --policy rkv"),
    (["chat", "--policy", "streaming", "--consensus", "2"],
     "--consensus is read by zoomr only, not by --policy streaming"),
    (["solve", "--rescue", "--base-policy", "rkv", "--sink", "2", "-p", "1+1"],
     "--sink is read by streaming only, not by --base-policy rkv"),
    (["bench", "--policies", "full,rkv", "--sink", "2"],
     "--sink is read by streaming only, and none of --policies is one of them"),
])
def test_knob_the_policy_does_not_read_is_refused(capsys, args, line):
    assert main([*args, "--no-live"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"zoomr: error: {line}", err


def test_only_typed_knobs_count(capsys):
    """model_options gives a command the knobs typed on the command line, default values included."""
    import typer.main

    from zoomr.cli.options import model_options

    seen = {}

    def probe(*, opts) -> int:
        seen["knobs"] = dict(opts.knobs)
        return 0

    app = typer.Typer()
    app.command("probe")(model_options()(probe))
    app.command("other")(lambda: None)
    command = typer.main.get_command(app)
    for argv, knobs in ((["probe"], {}), (["probe", "--budget", "64"], {"budget": 64}),
                        (["probe", "--sink=4", "--summaries", "auto"], {"sink": 4, "summaries": "auto"})):
        assert command(args=argv, standalone_mode=False) == 0
        assert seen["knobs"] == knobs, argv
