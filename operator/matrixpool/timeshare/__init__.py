"""Pure day/night capacity policy (no kopf, no Kubernetes client).

- :mod:`~matrixpool.timeshare.windows`: which window of a SuperNode is in force at an instant,
  and when the next one starts (IANA time zones, daylight saving, windows past midnight).
- :mod:`~matrixpool.timeshare.split`: the target split of the pool's cards between inference
  and training in a window.

The time-sharing controller (:mod:`matrixpool.controllers.timeshare`) calls both, with
instants from :mod:`matrixpool.clock`.

Errors (broken inputs the CRD rules normally exclude)::

    ValueError
     ├── windows.UnknownTimezoneError   spec.timeSharing.timezone is not in the tz database
     └── windows.InvalidWindowsError    the windows do not cover the day exactly once

What may be written here: functions of a spec and an instant. No I/O, no clock of its own.
"""
