from tests.cluster.netns import make_cluster  # noqa: F401  (the fixture)
