"""Profilers and walks run by hand through pytest, for the suite's fixtures (conftest.py).

They measure and assert nothing, so they are not tests: `python -m pytest` never collects
them (testpaths is tests/, and their names do not start with `test_`); each is run by naming
its file, as its docstring shows.
"""
