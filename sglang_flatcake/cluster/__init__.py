"""Beyond one machine: find a stored prefix's owner node (``directory``) and move its bytes
through Mooncake's Transfer Engine (``transfer``, ``owner``, ``requester``).

Wired into the server by ``--flatcake-cluster-directory``: ``node.ClusterNode`` (lease,
owner service, ``publisher``, reader) and ``to_slots`` (a remote tail into KV slots)."""
