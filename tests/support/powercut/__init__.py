"""A disk that keeps only what was fsynced, over FUSE, to cut the power under a test.

`disk` is the pure model, `fusefs` serves it, `fixture.PowerCut` mounts it and cuts,
`machine` starts what runs on it (nats-server, the coordinator, the test's peers).
"""
