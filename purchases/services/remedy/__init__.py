"""The compensate boundary: after a paid purchase fails, a linked refund or a named
escalation; chain refunds closed on evidence; staff actions from the case file; a batch row
no job can process put in front of support."""
