# Short recipes; each calls dev.py, which needs nothing but Python 3.11+.

setup:
    python3 dev.py setup

demo *ARGS:
    python3 dev.py demo {{ARGS}}

example *ARGS:
    python3 dev.py example {{ARGS}}

test *ARGS:
    python3 dev.py test {{ARGS}}

lint:
    python3 dev.py lint

# promtool (Debian's prometheus package, the binary alone), for the alert rules' test
promtool:
    bash .ci/promtool

bench *ARGS:
    python3 dev.py bench {{ARGS}}

server *ARGS:
    .venv/bin/txactors server {{ARGS}}
