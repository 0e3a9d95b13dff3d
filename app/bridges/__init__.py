"""The only doors from Qt to the back ends.

The local engine's events become Qt signals carrying (session id, request id); remote
providers' replies arrive as the same signals, so a pane does not know which one it talks to.
"""
