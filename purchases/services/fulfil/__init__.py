"""The execute-and-deliver boundary: the paid work run exactly once (claimed, started or
resumed, stored, rechecked when unknown, staged again when lost), the result delivered or
awaited, and its signed receipt."""
