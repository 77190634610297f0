"""Bad-input cases of tests/test_cli.py run through `rlmm.cli.main` one after another in this one process:
`python -m tests.bad_input_cases CASES.json RESULTS.json`, CASES a list of [app, [args...]], RESULTS each
case's exit code and stderr. About 1 s a case instead of ~6 s for a process of its own (the imports); the
`rlmm` command itself is run on a few of them in tests/test_cli.py."""
import contextlib
import io
import json
import sys

from rlmm.runtime.runtime_env import set_runtime_env


def run_cases(cases: list) -> list[dict]:
    from rlmm.cli import main

    results = []
    for app, args in cases:
        stderr, code = io.StringIO(), 0
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            try:
                main([app, *args])
            except SystemExit as exit:
                code = exit.code
        results.append({"app": app, "args": args, "code": code, "stderr": stderr.getvalue()})
    return results


if __name__ == "__main__":
    set_runtime_env()
    with open(sys.argv[1]) as cases, open(sys.argv[2], "w") as results:
        json.dump(run_cases(json.load(cases)), results)
