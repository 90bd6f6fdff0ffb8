"""The incident explorer: ``/detproxy/ui`` on the admin listener and ``detproxy report --html``.

Data flows one way: records (the incident ring or log files), tallies and the upstream's
fingerprint readings go through pure functions into frozen view models (``incident``,
``overview``), which ``render`` turns into self-contained HTML (own CSS, a little own JS,
inline SVG charts; nothing fetched from anywhere).
"""
