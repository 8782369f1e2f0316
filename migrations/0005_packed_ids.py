"""Schema 5: answered ids may leave the id registry for a packed form, and intakes are tasks.

Nothing to move. What changes is what a key may hold, so code of schema 4 must not run against a
Redis that code of schema 5 wrote:

* ``M:job:J:packed`` (lua/compact_ids.lua): answered ids leave ``M:in:J:sums`` and the done marks
  ``M:job:J:items`` for 16 bytes each (8 of SHA-1(id), 8 of the content sum). Schema-4 code reads
  only the registry and the marks, and would take a packed id for a new one: a re-sent item
  would run twice.
* ``cdr:job:J:intake`` and ``cdr:intake:tasks`` (conductor/intake/intake_task.py): a file's intake
  is a resumable task; schema-4 code neither resumes nor stops one.

The version bump alone does the work: ``schema.check`` makes schema-4 code refuse this Redis
("this conductor knows up to 4: upgrade it"), and schema-5 code refuses a schema-4 Redis until
``conductor migrate`` has run, so an upgrade stops the old fleet first.
"""

VERSION = 5


def up(client) -> None:  # noqa: ANN001 - a redis.Redis
    return None
