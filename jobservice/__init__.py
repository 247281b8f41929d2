"""A stand-in for an external job service, run as its own process: `python -m jobservice.server`.

Stdlib only, so it shares nothing with Tollbooth but HTTP. Used by the tests and the demo.
"""
