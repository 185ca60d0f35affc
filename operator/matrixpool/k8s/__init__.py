"""The only package that talks to the Kubernetes API server and the node checkpoint daemons.

``client`` (API clients and retries), ``executor`` (every action a controller takes: the live
one and the interface a recording one implements), ``pods`` (pod manifests and the two-phase
binding), ``convert`` (API objects into the facts the indexes hold), ``daemons`` (the
operator's daemon client and its credential), ``daemonleases``, ``secrets``, ``scrape``,
``anchor``.

What may be written here: I/O and the conversions it needs. No decisions (they are the
controllers'), no kopf handlers, no memory kept between calls.
"""
