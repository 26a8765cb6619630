"""How long a test waits for a child process before calling it hung.

A hang guard, not a speed expectation: on this project's 2-core machines under load (another test run, an
install, a server starting beside the tests: load averages of 15-20 were seen) a child that imports torch can
take minutes, and a test that failed because a 120 s limit ran out was a false failure (docs/testing.md, "The
flake hunt"). What a test asserts about a child is its output, never how fast it came; the whole test is still
bounded by pytest-timeout (pyproject.toml).
"""

CHILD_TIMEOUT_S = 600.0
