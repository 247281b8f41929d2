"""The suite's fixtures for the drivers here: tests/conftest.py, registered as a plugin, and
with it the fixture modules it registers (tests/fixtures/*, tests/x402/e2e.py).

pytest takes `pytest_plugins` from a conftest below the rootdir only when it loads it before
collecting, that is when the drivers (or this folder) are named on the command line, as
their docstrings run them. Not `pytest bench` (found while collecting, refused), and not
with tests/ in the same run (tests/conftest.py would be registered twice).
"""

pytest_plugins = ["tests.conftest"]
