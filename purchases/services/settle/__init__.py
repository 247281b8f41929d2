"""The settle boundary: a recorded payment settled on its rail and what the money's keeper
said recorded; resubmission, finality and money that lands late."""
