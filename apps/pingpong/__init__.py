"""Two actors talking over NATS: the smallest complete txactors program."""
