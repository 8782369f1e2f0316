"""Every Redis key name the conductor uses, in one place.

All keys of one model share the hash tag ``{model}`` so that every Lua script touches a
single slot: the same scripts run on one Redis, on Valkey and on Redis Cluster. The Lua
scripts receive ``KEYS[1] = ModelKeys.base`` (``cdr:{model}``) and derive per-shape and
per-lane names from it with the same suffixes as below (tests/test_keys.py checks that every
suffix the scripts build is one listed here).

Layout (``M`` = ``cdr:{model}``, ``S`` = shape signature hex, ``E`` = shape epoch,
``L`` = lane id, ``J`` = job name)::

    cdr:schema                      string   schema version of this Redis (migrations/)
    cdr:schema:lock                 string   who runs the migrations now (TTL, renewed while they run;
                                             conductor/redis_contract/schema.py): one runner, others wait
    cdr:models                      set      models that have ever received items
    cdr:jobs                        zset     job -> creation time (ms)
    cdr:job:J:models                set      models a job submitted to
    cdr:job:J:meta                  hash     the job's lifecycle (conductor/jobs/job_state.py): status, its
                                             timestamps (s), completion window, metadata, and for a
                                             batch made by conductor serve its input file and endpoint;
                                             input_path (the file a CLI submit read) and input_lines
                                             (its line count: the intake records it with refused_lines,
                                             the lines it refused) for the job ledger
                                             (conductor/jobs/job_ledger.py) and conductor status
    cdr:jobs:deadlines              zset     job -> expires_at (s), jobs with a completion window
    cdr:tenants                     hash     tenant -> weight (`conductor tenant`), copied to each model's M:tenants
    cdr:lease:expiry                string   who ends the jobs past their window now (TTL): a maintenance
                                             lease holder or a serve replica (conductor/jobs/job_state.py)
    cdr:lease:finalize              string   which serve replica finalizes batches now (TTL; conductor/api/finalize.py)
    cdr:batches                     zset     job -> created_at (s), the batches conductor serve made
    cdr:batches:open                zset     job -> created_at (s), the batches not yet ended: those the
                                             finalizer (conductor/api/finalize.py) moves to finalizing,
                                             writes the output and error files of, and completes
    cdr:files                       zset     file id -> created_at (s), files uploaded to conductor serve
    cdr:file:F                      hash     an uploaded file's object (conductor/api/upload_store.py); its
                                             bytes live in the store directory, not in Redis
    cdr:apikeys                     zset     API key id -> created (s): every key `conductor keys create` made,
                                             revoked ones included (conductor/jobs/tenant_keys.py); a serve
                                             replica asks for keys as soon as this exists (issue 35)
    cdr:apikey:ID                   hash     one API key: tenant, role (user, admin), label, salt and hash
                                             (PBKDF2-SHA256 of its secret; the secret itself is never
                                             stored), created, last_used, revoked (s)
    cdr:tenants:limits              hash     tenant -> JSON of its limits (`conductor tenant T --max-...`):
                                             max_enqueued_tokens, max_file_bytes, requests_per_minute
    cdr:tenant:{T}:open             zset     batch -> its input tokens, tenant T's batches not yet ended: what
                                             counts against max_enqueued_tokens (lua/tenant_admit.lua adds;
                                             an ended batch is taken out at the next admission)
    cdr:tenant:{T}:opened           zset     batch -> when it was admitted (ms): a reservation whose batch
                                             never got recorded (its replica died in between) lapses
    cdr:tenant:{T}:rate:N           string   tenant T's requests in the minute N (s // 60), expiring
    cdr:tenant:{T}:files            zset     file id -> created_at (s), the files of tenant T (its keys' view)
    cdr:tenant:{T}:batches          zset     batch -> created_at (s), the batches of tenant T
    cdr:audit                       stream   the Batch API's creates, cancels, retries, downloads and deletes:
                                             key id, tenant, route, target, status (XADD MAXLEN ~ 100000;
                                             conductor/api/audit.py, `conductor audit`)
    cdr:job:J:intake                hash     the job's intake task (conductor/intake/intake_task.py): source
                                             (api, cli), input path, file id, endpoint, model defaults it
                                             was checked with, cursor (line: last line sent; sent: items),
                                             owner and lease_ms (expiry, ms), state (checking, sending,
                                             done, stopped, failed), reason and where it stopped;
                                             readable_ms: when a resumer that can read its file was too
                                             busy to take it (conductor/intake/intake_resume.py)
    cdr:intake:tasks                zset     job -> created (ms): intake tasks not yet ended (the resumers'
                                             index; lua/intake_lease.lua decides who runs one)
    M:cfg                           hash     per-model thresholds (conductor/redis_contract/config.py); with
                                             shards > 1 (issue 36) the model's shapes live on its shards
                                             ``m~s.k`` (conductor/redis_contract/shards.py), each a model of
                                             this layout whose cfg is a copy of this one
    M:shards_old                    hash     earlier shard count -> when it stopped being current (ms): its
                                             shards keep draining (workers serve them too) until the lease
                                             holder finds them empty (workers/shard_maintenance.py)
    M:shard_of                      hash     signature -> its shard under the current count, recorded at its
                                             first submit (the least loaded shard, then stable)
    M:moving                        hash     token -> shape signature: batches an old shard handed over
                                             (lua/hand_over.lua) whose items the migration has yet to submit
                                             to their new shard; 'sig:dv' for a batch delivered before (dv:
                                             its items' next delivery count, carried by lua/hand_in.lua)
    M:moving:T                      list     the item records of one of them (conductor/client/shard_migrate.py)
    M:state                         hash     the fleet's model state: gate, cleanup, in-flight and finished
                                             counters, pause (workers write it; producers only read it;
                                             every field in STATE_FIELDS below)
    M:intake                        hash     the producer's model counters: waiting tokens and items
                                             (claim.lua takes them down), submitted, last_intake_ms,
                                             sealed_ms; stored_tokens and stored_items: what waits in
                                             store segments (register_segment.lua up, submit.lua down)
    M:active                        zset     active or draining shape instance "S:E" -> activation time (ms)
    M:affinity                      hash     worker -> the active instance it serves (it stays until empty)
    M:warming                       hash     worker -> the staged instance it warms, its next (pre-warm signal)
    M:staged                        zset     shape instance "S:E" -> waiting tokens, not yet active
    M:staged_age                    zset     staged instance -> creation time (ms), for aging
    M:finished                      stream   finished instances and their batch counts (thrash alarm)
    M:shape:S                       hash     signature record: current intake epoch, prefix blob;
                                             stored_tokens: its tokens waiting in store segments (disk
                                             tier; absent means 0: lua/lib.lua shape_stored_add)
    M:shape:S:segs                  zset     the shape's store segments (disk tier): name -> registration
                                             sequence, so the feeder finds a served shape's next one
                                             however many segments wait (register_segment.lua adds,
                                             the feeder and fail_stored.lua remove)
    M:inst:S:E                      hash     one shape instance (an epoch of a signature): state, counters
    M:inst:S:E:lanes                zset     lane id -> representative length (rolling lanes)
    M:inst:S:E:ready                zset     lane id -> lane id, lanes holding a full batch (round-robin)
    M:inst:S:E:fill                 zset     lane id -> representative length, every non-empty lane: the
                                             order in which a claim fills a batch from neighbouring lanes
    M:inst:S:E:free                 set      retired lane ids, reused before new ones
    M:inst:S:E:touch                zset     lane id -> last assignment time (ms), for lane hygiene
    M:lane:S:E:L                    list     waiting items of one lane, in arrival order, each an item
                                             record (below)
    M:lanetok:S:E:L                 list     input tokens of each item of the lane, same order and length:
                                             claim.lua packs from these without reading the items
    M:lanemeta:S:E:L                hash     rep, items, tokens, last assignment time of one lane
    M:batches                       stream   claimed batches; group "workers" holds in-flight ones.
                                             Fields: sig ep lane n (items) plen (padded length)
                                             w (consumer) ts (claimed at, ms) k (token) dv
                                             (deliveries of its items) fl (flags). claim.lua puts each
                                             new entry in its consumer's pending list with XCLAIM FORCE;
                                             nothing reads the group with '>'
    M:bat:T                         list     item records of the in-flight batch whose entry has k = T;
                                             written by claim.lua (SORT BY nosort STORE, so item bytes
                                             never pass through Lua), read by the claimer in the same
                                             pipeline, deleted by complete/fail/reclaim
    M:reclaimed                     list     batches taken back, served first; each msgpack
                                             [sig, epoch, lane, deliveries, [tokens], [item records]]
    M:dead                          stream   dead-lettered items with their last error (field "it" holds
                                             the item record)
    M:hb:W                          string   heartbeat of worker W (TTL)
    M:holding                       string   a sharded model's own keys: some worker holds batches on a shard
                                             or is about to claim (lua/heartbeat.lua, its TTL): the idle
                                             lease holder's beat reads it and sweeps its quiet shards
    M:beats                         zset     a sharded model's own keys: worker -> when the heartbeat its last
                                             idle beat set runs out (ms, Redis's clock; lua/idle_beat.lua):
                                             the holder's beat is told who lapsed and deletes their shard
                                             heartbeats (each lives a round of the shards)
    M:lease:maint                   string   which worker runs the periodic sweep (TTL)
    M:workers                       hash     worker -> registered contract (JSON)
    M:tenants                       hash     tenant -> weight (`conductor tenant T --weight W`; default 1): its
                                             share of the fleet among the tenants with work waiting (issue 26)
    M:vtc                           hash     tenant -> virtual token counter: the service its batches cost
                                             (padded input tokens + decode_weight x the output expected of
                                             its limits) over its weight, charged at claim, lifted on return
                                             (lua/lib_fair.lua)
    M:vtc_ratio                     hash     "T:lim" / "T:out" -> output limits charged and output tokens
                                             reported of tenant T's recent results ("#:": every tenant's;
                                             halved as they grow): the output a claim expects of a limit
                                             (lua/lib_service.lua, lua/lib_fair.lua)
    M:vtc_seen                      hash     tenant -> when a claim's sweep last saw its work waiting (ms)
    M:served                        hash     "T:in" / "T:out" -> padded input tokens and output tokens of
                                             tenant T's completed items (complete.lua; verify checks them)
    M:served10:N                    hash     the same, for the ten seconds N (s // 10), expiring: the last
                                             minute's shares
    M:hot                           zset     interactive shape instance -> when its items began waiting: served
                                             before any other work (lua/lib_serve.lua serve_hot)
    M:busy                          hash     worker -> its busy time in ms (sequences in its engine) since it
                                             started, as of its last heartbeat: the exporter's fleet balance
    M:segs                          zset     store segments waiting to be fed (disk tier, conductor/tier/spill.py):
                                             segment name -> registration sequence (oldest first)
    M:seg:N                         hash     one segment's index record: job, sig, path, items, tokens,
                                             lmin, lmax (input token range), sum (SHA-1 of the file), seq,
                                             shape (the signature its items join, qualified by the job's
                                             class; absent on segments registered before issue 37)
    M:seg:N:ids                     list     the ids the segment was registered with, in its order
                                             (register_segment.lua): what a cancel answers and a repair
                                             of a lost file fails without reading the store; dropped
                                             with the index record (about 11 bytes an id)
    M:in:J                          hash     the producer's job counters for this model: declared,
                                             submitted, submitted_tokens; its class (lua/job_class.lua):
                                             tenant, prio (interactive, batch, background), deadline_ms
    M:in:J:sums                     hash     the job's id registry: item id -> its content's sum (16 hex
                                             digits of SHA-1(sig || record); '-' for an id submitted before
                                             sums were kept): a re-submitted id must bring the same content;
                                             an id waiting in a store segment is in M:in:J:stored instead
                                             until a lane takes it, and an answered id may leave it for
                                             M:job:J:packed (below): every check finds it in all three
    M:in:J:stored                   hash     the job's ids waiting in store segments (schema 6, issue 25):
                                             the layout of M:job:J:packed (k, n, buckets of 16-byte
                                             records: 8 bytes of SHA-1(id), 8 of its content sum;
                                             lua/lib_packed.lua), about 16 bytes an id instead of the
                                             registry's 80; register_segment.lua adds, submit.lua (the
                                             feed) and fail_stored.lua take out; the segment of an id is
                                             the one whose M:seg:N:ids names it
    M:job:J                         hash     the fleet's job counters for this model: completed, failed
                                             (cancelled and expired: how many of failed lua/lib_cancel.lua answered)
    M:job:J:items                   hash     item id -> d: the item has its result (effectively-once)
    M:job:J:packed                  hash     answered ids moved out of M:in:J:sums and M:job:J:items by the
                                             lease holder (lua/compact_ids.lua; issue 25): k (bucket digits),
                                             n (ids held), and per bucket b<hex> a string of 16-byte records
                                             (8 bytes of SHA-1(id), 8 of its content sum): lua/lib_packed.lua
    M:job:J:results                 stream   result records of the job for this model, JSON
    M:bell                          list     doorbell: submit.lua and seal.lua push a few entries (capped)
                                             when work may have become claimable; idle workers BLPOP it
    M:reply:J:I                     list     the result record of request item I of job J (a request job,
                                             name starting rq.), pushed by complete.lua with a short TTL;
                                             the waiting RequestClient BLPOPs it (conductor/client/request.py)
    M:job:J:rsegs                   list     result segments in the store (disk tier,
                                             conductor/tier/result_segments.py), in stream order: JSON
                                             {path, first, last, n, sum}

Who may write what (deploy/redis/users.acl): a producer writes only M:intake, M:in:*, the shape,
instance and lane keys (through submit.lua, seal.lua and declare.lua) and the global job and
model registries, and M:shard_of (a new shape's shard, HSETNX; conductor/client/shard_route.py);
everything else, results and counters of finished work included, is the workers'. Schema 3
(migrations/0003) split the producer's keys from the workers'.

An item record is the JSON array text ``[id, job, input_tokens, max_tokens, prompt, payload]``
(``records.BatchItem`` decodes it as an array-like struct). The producer builds it
(conductor/redis_contract/item_record.py, for submit.lua's ARGV and for store segments);
submit.lua decodes it to check every field and stores the bytes as sent. Schema 2
(migrations/0002) moved lanes from streams of fields to these lists. Schema 4 (migrations/0004)
moved what the scripts used to convert on the fly: the one active instance once named in M:state
(field ``active``) is in M:active, and every dead letter holds its item record (``it``). Schema 6
(migrations/0006) moved the registry marks of store-waiting ids ('s<seq>:<sum>') to M:in:J:stored
and M:seg:N:ids.
"""

from __future__ import annotations

from conductor.redis_contract import rules
from conductor.redis_contract.shards import fold, is_shard

PREFIX = "cdr"
SCHEMA_KEY = f"{PREFIX}:schema"
SCHEMA_LOCK_KEY = f"{PREFIX}:schema:lock"
MODELS_KEY = f"{PREFIX}:models"
JOBS_KEY = f"{PREFIX}:jobs"
# Jobs whose names start with this are request jobs (conductor/client/request.py): complete.lua also
# hands each new result to the waiting caller on M:reply:J:I (rules.py holds it, with the list's life).
REQUEST_JOB_PREFIX = rules.REQUEST_JOB_PREFIX
GROUP = "workers"

# Every field of M:state, with what it holds; tests/test_keys.py checks that every field a script
# of lua/ writes there is listed. Counters are whole numbers; *_ms fields are times in ms. (The
# waiting counters and intake times are the producer's, in M:intake: see the layout above.)
STATE_FIELDS: dict[str, str] = {
    "completed": "items completed with a result (complete.lua)",
    "failed": "items completed with an error result, dead-lettered ones included",
    "gate": "1 once the release gate opened (it stays open)",
    "gate_opened_ms": "when the release gate opened",
    "cleanup": "1 while the model is in cleanup mode (lua/lib_cleanup.lua; claim.lua ends it on new intake)",
    "cleanup_since_ms": "when the current cleanup period began",
    "cleanup_entries": "cleanup periods entered",
    "cleanup_ms": "time spent in cleanup periods that ended",
    "cleanup_batches": "batches dispatched in cleanup",
    "cleanup_items": "items dispatched in cleanup",
    "batches": "batches ever dispatched",
    "inflight_batches": "batches claimed and not yet completed, failed or reclaimed",
    "inflight_items": "items of the in-flight batches",
    "reclaimed_items": "items in M:reclaimed, served before the lanes",
    "requeued_items": "items ever given back to M:reclaimed (reclaim.lua, fail.lua)",
    "reclaims": "batches taken back from dead or lease-lost consumers",
    "dead_lettered": "items ever dead-lettered",
    "dead_retried": "dead-lettered items sent back by dead_retry.lua",
    "activations": "shape instances activated",
    "preemptions": "active instances stepped back to staged by aging",
    "fair_switches": "workers that left their shape for a tenant short of its share (lua/lib_rebalance.lua rebalance)",
    "fair_loans": "batches a worker took, keeping its shape, for a tenant behind in service (lua/lib_rebalance.lua "
    "lend)",
    "shapes_finished": "shape instances emptied and finished",
    "warming": "the shape instance last marked warming (for inspect)",
    "warmings": "instances marked warming (pre-warm signals)",
    "neighbour_fills": "batches filled from more than one lane",
    "hygiene_drains": "small idle lanes force-drained by lane hygiene",
    "lanes_retired": "lanes emptied, quiet, and their ids returned for reuse",
    "reindexes": "shape instances whose fill/ready indices were re-derived (lib.lua reindex)",
    "sweep_ms": "when claim.lua next sweeps for aging and lane hygiene",
    "paused": "1 while the model is paused (Conductor.pause): every writing script refuses",
}


def check_name(kind: str, value: str) -> str:
    """``value`` when it is a valid name (rules.py NAME_RE, which the scripts' name_ok applies too)."""
    if (
        not isinstance(value, str)
        or not rules.NAME_RE.match(value)
        or ("~" in value and not (kind == "model" and is_shard(value) and "~" not in fold(value)))
    ):
        raise ValueError(
            f"{kind}: {value!r} is not a valid name (1-{rules.NAME_MAX} characters from A-Z a-z 0-9 . _ / @ + = -)"
        )
    return value


def job_models_key(job: str) -> str:
    return f"{PREFIX}:job:{job}:models"


def job_meta_key(job: str) -> str:
    return f"{PREFIX}:job:{job}:meta"


JOB_DEADLINES_KEY = f"{PREFIX}:jobs:deadlines"
# tenant -> weight, the registry `conductor tenant` writes beside each model's M:tenants (a model made
# later takes the weights from here: conductor/client/core.py ensure_model)
TENANTS_KEY = f"{PREFIX}:tenants"
# Who ends the jobs past their completion window now (conductor/jobs/job_state.py expire_due_leased).
EXPIRY_LEASE_KEY = f"{PREFIX}:lease:expiry"
# Who finalizes the batches whose lines are all answered now (conductor/api/finalize.py).
FINALIZE_LEASE_KEY = f"{PREFIX}:lease:finalize"
FILES_KEY = f"{PREFIX}:files"
BATCHES_KEY = f"{PREFIX}:batches"
# Batches not yet ended (conductor/api/finalize.py: the serve replicas' finalizer looks at these).
BATCHES_OPEN_KEY = f"{PREFIX}:batches:open"


def file_key(file_id: str) -> str:
    return f"{PREFIX}:file:{file_id}"


# API keys (conductor/jobs/tenant_keys.py): the index of every key made, and each key's record.
APIKEYS_KEY = f"{PREFIX}:apikeys"


def apikey_key(key_id: str) -> str:
    return f"{PREFIX}:apikey:{key_id}"


# tenant -> its limits as JSON (conductor/jobs/tenant_limits.py): one key, so `conductor tenants` lists them all
TENANT_LIMITS_KEY = f"{PREFIX}:tenants:limits"
# The Batch API's audit stream (conductor/api/audit.py), capped at about AUDIT_MAXLEN entries.
AUDIT_KEY = f"{PREFIX}:audit"


class TenantKeys:
    """Key names of one tenant's API use (issue 35); they share the hash tag ``{tenant}``, so that
    lua/tenant_admit.lua touches one slot."""

    __slots__ = ("tenant", "base")

    def __init__(self, tenant: str) -> None:
        self.tenant = check_name("tenant", tenant)
        self.base = f"{PREFIX}:tenant:{{{tenant}}}"

    @property
    def open(self) -> str:
        return f"{self.base}:open"

    @property
    def opened(self) -> str:
        return f"{self.base}:opened"

    def rate(self, minute: int) -> str:
        return f"{self.base}:rate:{minute}"

    @property
    def files(self) -> str:
        return f"{self.base}:files"

    @property
    def batches(self) -> str:
        return f"{self.base}:batches"


# Durable intake (conductor/intake/intake_task.py): one hash per job's intake and the index of the open ones.
INTAKE_TASKS_KEY = f"{PREFIX}:intake:tasks"


def intake_task_key(job: str) -> str:
    return f"{PREFIX}:job:{job}:intake"


class ModelKeys:
    """Key names for one model; every name carries the model's hash tag."""

    __slots__ = ("model", "base")

    def __init__(self, model: str) -> None:
        self.model = check_name("model", model)
        self.base = f"{PREFIX}:{{{model}}}"

    @property
    def cfg(self) -> str:
        return f"{self.base}:cfg"

    @property
    def state(self) -> str:
        return f"{self.base}:state"

    @property
    def shards_old(self) -> str:
        return f"{self.base}:shards_old"

    @property
    def shard_of(self) -> str:
        return f"{self.base}:shard_of"

    @property
    def moving(self) -> str:
        return f"{self.base}:moving"

    def moving_items(self, token: str) -> str:
        return f"{self.base}:moving:{token}"

    @property
    def staged(self) -> str:
        return f"{self.base}:staged"

    @property
    def active(self) -> str:
        return f"{self.base}:active"

    @property
    def affinity(self) -> str:
        return f"{self.base}:affinity"

    @property
    def warming(self) -> str:
        return f"{self.base}:warming"

    @property
    def staged_age(self) -> str:
        return f"{self.base}:staged_age"

    @property
    def finished(self) -> str:
        return f"{self.base}:finished"

    @property
    def batches(self) -> str:
        return f"{self.base}:batches"

    @property
    def reclaimed(self) -> str:
        return f"{self.base}:reclaimed"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def workers(self) -> str:
        return f"{self.base}:workers"

    @property
    def busy(self) -> str:
        return f"{self.base}:busy"

    @property
    def tenants(self) -> str:
        return f"{self.base}:tenants"

    @property
    def vtc(self) -> str:
        return f"{self.base}:vtc"

    @property
    def vtc_ratio(self) -> str:
        return f"{self.base}:vtc_ratio"

    @property
    def vtc_seen(self) -> str:
        return f"{self.base}:vtc_seen"

    @property
    def served(self) -> str:
        return f"{self.base}:served"

    def served10(self, tens: int) -> str:
        return f"{self.base}:served10:{tens}"

    @property
    def hot(self) -> str:
        return f"{self.base}:hot"

    def shape(self, sig: str) -> str:
        return f"{self.base}:shape:{sig}"

    def shape_segs(self, sig: str) -> str:
        return f"{self.base}:shape:{sig}:segs"

    def inst(self, inst: str) -> str:
        """``inst`` is ``"S:E"``: a signature and its epoch."""
        return f"{self.base}:inst:{inst}"

    def inst_lanes(self, inst: str) -> str:
        return f"{self.base}:inst:{inst}:lanes"

    def inst_ready(self, inst: str) -> str:
        return f"{self.base}:inst:{inst}:ready"

    def inst_fill(self, inst: str) -> str:
        return f"{self.base}:inst:{inst}:fill"

    def inst_free(self, inst: str) -> str:
        return f"{self.base}:inst:{inst}:free"

    def lane(self, inst: str, lane: int | str) -> str:
        return f"{self.base}:lane:{inst}:{lane}"

    def lane_tok(self, inst: str, lane: int | str) -> str:
        return f"{self.base}:lanetok:{inst}:{lane}"

    def batch_items(self, token: str) -> str:
        return f"{self.base}:bat:{token}"

    def lanemeta(self, inst: str, lane: int | str) -> str:
        return f"{self.base}:lanemeta:{inst}:{lane}"

    @property
    def maint_lease(self) -> str:
        return f"{self.base}:lease:maint"

    @property
    def holding(self) -> str:
        """A sharded model's own keys: some worker holds batches on a shard (or is about to claim), set
        by its heartbeat for the TTL (lua/heartbeat.lua), read by the idle lease holder's beat."""
        return f"{self.base}:holding"

    @property
    def beats(self) -> str:
        """A sharded model's own keys: worker -> when its last idle beat's heartbeat runs out (ms, Redis's
        clock; lua/idle_beat.lua): the holder's beat finds who lapsed there, and deletes their shard
        heartbeats, which live a round of the shards."""
        return f"{self.base}:beats"

    def heartbeat(self, worker: str) -> str:
        return f"{self.base}:hb:{worker}"

    def job(self, job: str) -> str:
        return f"{self.base}:job:{job}"

    @property
    def intake(self) -> str:
        return f"{self.base}:intake"

    @property
    def segs(self) -> str:
        return f"{self.base}:segs"

    def seg(self, name: str) -> str:
        return f"{self.base}:seg:{name}"

    def seg_ids(self, name: str) -> str:
        return f"{self.base}:seg:{name}:ids"

    def job_intake(self, job: str) -> str:
        return f"{self.base}:in:{job}"

    def job_items(self, job: str) -> str:
        return f"{self.base}:job:{job}:items"

    def job_packed(self, job: str) -> str:
        return f"{self.base}:job:{job}:packed"

    def job_sums(self, job: str) -> str:
        return f"{self.base}:in:{job}:sums"

    def job_stored(self, job: str) -> str:
        return f"{self.base}:in:{job}:stored"

    def job_results(self, job: str) -> str:
        return f"{self.base}:job:{job}:results"

    @property
    def doorbell(self) -> str:
        return f"{self.base}:bell"

    def reply(self, job: str, item_id: str) -> str:
        return f"{self.base}:reply:{job}:{item_id}"

    def job_rsegs(self, job: str) -> str:
        return f"{self.base}:job:{job}:rsegs"
