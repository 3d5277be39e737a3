"""The integration tests' fixtures: real nats-servers (tests/support/servers.py) and the
3-node `nats_cluster` (tests/support/cluster.py). Here, not in tests/conftest.py, so that a
unit run starts and imports no server fixture."""

from tests.support.cluster import nats_cluster
from tests.support.servers import make_nats_server, nats_server, nc, private_nc

__all__ = ["make_nats_server", "nats_cluster", "nats_server", "nc", "private_nc"]
