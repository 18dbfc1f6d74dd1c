"""What both sides share: the messages, their transport, pickling, the call and its shared memory.

The rank side imports only this folder, ``worker`` and ``errors``.
"""
