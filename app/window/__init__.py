"""The main window and what hangs on it.

The window wires the rooms together: the command table (actions), the pane deck that holds
the chats side by side, the banners (storage, BLAS, loading), the dock fit of the KV monitor
and the API server panel. It is the top room: nothing below imports it.
"""
