"""Work run apart from any request: the beat jobs that find every waiting state again
(reconciliation, housekeeping) and the books export of a closed period."""
