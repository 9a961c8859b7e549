"""The strategies on an emulated, network-bound cluster: hosts are network namespaces with
shaped links (``netcluster``); ``cluster`` runs the strategy table's strategies against DDP,
``link_ceiling`` what the links carry without any framework, ``link_timeline`` how a link's use
is made up.  Results: docs/cluster.md."""
