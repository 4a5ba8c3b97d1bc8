"""Network plane: the libp2p host wrapper, DHT membership, chunk relay, node daemon, status CLI."""
