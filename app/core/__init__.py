"""The app's Qt-free core: records, persistence, settings, secrets and the chat logic.

Everything here runs without a window or an event loop, so it is unit-tested on its own and
reused by any front end. The layer is enforced: import-linter (pyproject.toml) forbids Qt here.
"""
