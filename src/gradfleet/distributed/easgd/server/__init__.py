"""The asynchronous EASGD centre's state machine (``centre_server``), pure: hosted by
``..async_centre`` or a dedicated server rank.

Layer: algorithms.
"""
