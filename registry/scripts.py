"""Lua scripts: each state change and its event in one atomic script, every check before the first write.

Redis layout (prefix `ot:`):
    ot:adapters                       zset of live adapter names (score 0, paged by lex range)
    ot:adapter:{name}                 hash: proto (Adapter bytes), deleted 0|1, create_ms, serving (the
                                      serving alias; absent: latest)
    ot:adapter:{name}:seq             version counter (INCR: contiguous, never reused)
    ot:adapter:{name}:versions        zset of version numbers (score = number)
    ot:adapter:{name}:aliases         hash alias -> version
    ot:adapter:{name}:history:{alias} list of earlier versions of the alias, newest first (rollback)
    ot:adapter:{name}:requests        hash request_id -> "version event_id" (idempotent publish)
    ot:version:{name}:{n}             hash: proto (Version bytes), publish_ms, artifact_sha256, deleted 0|1
    ot:artifact:{sha256}:refs         set of "name@n" using the artifact (GC deletes files at zero)
    ot:artifact:{sha256}:uploaders    set of tenants that uploaded the artifact ("" with auth off)
    ot:artifact:{sha256}:leases       zset lease id -> expiry ms: a publish or upload that needs the bytes kept
    ot:artifacts:deleting             zset sha256 -> claim ms: artifacts whose deletion is decided (tombstones)
    ot:uploads                        zset sha256 -> upload ms: uploads no version has taken over yet
    ot:tenant:{tenant}:uploads        hash sha256 -> bytes: what counts to the tenant's storage quota
    ot:tenant:{tenant}:reserved       hash upload id -> "bytes expiry_ms": uploads in progress (quota reserved)
    ot:events                         stream; fields: type adapter version alias previous aliases
                                      time actor cause artifact serving (absolute state; replay-safe)

Lua scripts do not roll back, so a rejected call must fail before it writes anything, including INCR.
Errors are returned as `redis.error_reply("REASON message")`; the store maps REASON to a status.

Artifact bytes live outside Redis, so deleting them cannot be part of a script. Instead the decision is: one
script (claim_artifact) checks that nothing references the artifact, no lease is live and no recent upload
awaits publishing, and in the same step takes the artifact out of every tenant's quota and writes its tombstone.
Only then are the bytes deleted, and then the tombstone is removed. A publish or upload first takes a lease
(refused while a tombstone exists), then verifies or writes the bytes, and its script requires the lease to be
still there: a claim removes every lease of the artifact, so a publish can never reference bytes that a claim
has decided to delete.
"""

from __future__ import annotations

# Shared prologue: event append with the adapter's whole alias map (absolute state).
_EMIT = """
local function alias_map(aliases_key)
  local flat = redis.call('HGETALL', aliases_key)
  local map = {}
  for i = 1, #flat, 2 do map[flat[i]] = tonumber(flat[i + 1]) end
  if next(map) == nil then return '{}' end
  return cjson.encode(map)
end
local function emit(events_key, maxlen, fields)
  local args = {events_key, 'MAXLEN', '~', maxlen, '*'}
  for k, v in pairs(fields) do table.insert(args, k); table.insert(args, tostring(v)) end
  return redis.call('XADD', unpack(args))
end
local function serving_of(adapter_key)
  return redis.call('HGET', adapter_key, 'serving') or ''
end
local function live_adapter(adapter_key, name)
  if redis.call('EXISTS', adapter_key) == 0 or redis.call('HGET', adapter_key, 'deleted') == '1' then
    return redis.error_reply('ADAPTER_NOT_FOUND adapter ' .. name .. ' not found')
  end
  return nil
end
"""

# Shared prologue: the deletion decision. refs, uploaders, leases, deleting, uploads: the artifact's keys;
# tenant_prefix .. tenant .. ':uploads' is a tenant's quota hash. cutoff: uploads after it are kept (grace).
# Returns 1 when claimed (the caller deletes the bytes, then removes the tombstone), 0 when kept.
_CLAIM = """
local function claim_artifact(refs, uploaders, leases, deleting, uploads, tenant_prefix, sha, now, cutoff)
  if redis.call('SCARD', refs) > 0 then return 0 end
  if redis.call('ZSCORE', deleting, sha) then return 0 end
  if redis.call('ZCOUNT', leases, '(' .. now, '+inf') > 0 then
    -- A publish or upload holds it; if that one fails, the sweep must still find the unreferenced bytes.
    redis.call('ZADD', uploads, 'NX', now, sha)
    return 0
  end
  local uploaded = redis.call('ZSCORE', uploads, sha)
  if uploaded and tonumber(uploaded) > tonumber(cutoff) then return 0 end
  for _, tenant in ipairs(redis.call('SMEMBERS', uploaders)) do
    redis.call('HDEL', tenant_prefix .. tenant .. ':uploads', sha)
  end
  redis.call('DEL', uploaders, leases)
  redis.call('ZREM', uploads, sha)
  redis.call('ZADD', deleting, now, sha)
  return 1
end
"""

# KEYS: adapter, adapters, aliases, events   ARGV: name, proto, now_ms, actor, maxlen
CREATE_ADAPTER = (
    _EMIT
    + """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HGET', KEYS[1], 'deleted') ~= '1' then
  return redis.error_reply('ADAPTER_EXISTS adapter ' .. ARGV[1] .. ' already exists')
end
redis.call('HSET', KEYS[1], 'proto', ARGV[2], 'deleted', '0', 'create_ms', ARGV[3])
redis.call('HDEL', KEYS[1], 'serving')
redis.call('ZADD', KEYS[2], 0, ARGV[1])
return emit(KEYS[4], ARGV[5], {type='ADAPTER_CREATED', adapter=ARGV[1], time=ARGV[3], actor=ARGV[4],
  cause='create', aliases=alias_map(KEYS[3])})
"""
)

# KEYS: adapter, adapters, aliases, events   ARGV: name, now_ms, actor, maxlen
DELETE_ADAPTER = (
    _EMIT
    + """
local err = live_adapter(KEYS[1], ARGV[1]); if err then return err end
redis.call('HSET', KEYS[1], 'deleted', '1')
redis.call('HDEL', KEYS[1], 'serving')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return emit(KEYS[4], ARGV[4], {type='ADAPTER_DELETED', adapter=ARGV[1], time=ARGV[2], actor=ARGV[3],
  cause='delete', aliases='{}'})
"""
)

# KEYS: adapter, seq, versions, aliases, requests, events, artifact_refs, version_prefix, history_prefix,
#       artifact_leases, uploads, placement (placement_scripts.py)
# ARGV: name, proto, artifact_sha256, now_ms, actor, maxlen, request_id, skip_latest(0|1),
#       expected_latest('' = none), lease_id, owner_epoch (0 = unfenced), alias1, alias2, ...
# The lease was taken before the bytes were verified; if it is gone, a claim decided to delete them since.
PUBLISH_VERSION = (
    _EMIT
    + """
local err = live_adapter(KEYS[1], ARGV[1]); if err then return err end
if ARGV[7] ~= '' then
  local done = redis.call('HGET', KEYS[5], ARGV[7])
  if done then return {'REPLAY', done} end
end
if ARGV[11] ~= '0' then
  local epoch = redis.call('HGET', KEYS[12], 'epoch') or '0'
  if tonumber(epoch) ~= tonumber(ARGV[11]) then
    return redis.error_reply('STALE_EPOCH ' .. ARGV[1] .. ' is at placement epoch ' .. epoch .. ', not ' ..
      ARGV[11] .. ': another trainer owns it now')
  end
end
local newest = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[9] ~= '' and tonumber(ARGV[9]) ~= newest then
  return redis.error_reply('VERSION_CONFLICT newest version of ' .. ARGV[1] .. ' is ' .. newest ..
    ', expected ' .. ARGV[9])
end
if not redis.call('ZSCORE', KEYS[10], ARGV[10]) then
  return redis.error_reply('ARTIFACT_NOT_FOUND artifact sha256:' .. ARGV[3] ..
    ' was garbage-collected while this publish verified it: upload it again')
end
local v = redis.call('INCR', KEYS[2])
local vkey = KEYS[8] .. v
redis.call('HSET', vkey, 'proto', ARGV[2], 'publish_ms', ARGV[4], 'artifact_sha256', ARGV[3], 'deleted', '0')
redis.call('ZADD', KEYS[3], v, v)
redis.call('SADD', KEYS[7], ARGV[1] .. '@' .. v)
redis.call('ZREM', KEYS[10], ARGV[10])
redis.call('ZREM', KEYS[11], ARGV[3])  -- published: the version GC owns the bytes from now on, not the sweep
local moved = {}
if ARGV[8] ~= '1' then table.insert(moved, 'latest') end
for i = 12, #ARGV do table.insert(moved, ARGV[i]) end
for _, alias in ipairs(moved) do
  local prev = redis.call('HGET', KEYS[4], alias)
  if prev and tonumber(prev) ~= v then
    redis.call('LPUSH', KEYS[9] .. alias, prev)
    redis.call('LTRIM', KEYS[9] .. alias, 0, 999)
  end
  redis.call('HSET', KEYS[4], alias, v)
end
local id = emit(KEYS[6], ARGV[6], {type='VERSION_PUBLISHED', adapter=ARGV[1], version=v, time=ARGV[4],
  actor=ARGV[5], cause='publish', artifact=ARGV[3], aliases=alias_map(KEYS[4]), serving=serving_of(KEYS[1])})
if ARGV[7] ~= '' then redis.call('HSET', KEYS[5], ARGV[7], v .. ' ' .. id) end
return {'NEW', v .. ' ' .. id}
"""
)

# Moves an alias. mode: 'set' (push the old version to history), 'rollback-to' (same, target must be
# older), 'rollback' (target = newest usable entry popped from history; ARGV[3] ignored).
# KEYS: adapter, versions, aliases, history, events, version_prefix
# ARGV: name, alias, version, expected('' = none), now_ms, actor, maxlen, mode
SET_ALIAS = (
    _EMIT
    + """
local err = live_adapter(KEYS[1], ARGV[1]); if err then return err end
local cur = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
if ARGV[4] ~= '' and tonumber(ARGV[4]) ~= cur then
  return redis.error_reply('VERSION_CONFLICT alias ' .. ARGV[2] .. ' points to ' .. cur .. ', expected ' .. ARGV[4])
end
local function usable(v)
  return redis.call('ZSCORE', KEYS[2], v) and redis.call('HGET', KEYS[6] .. v, 'deleted') ~= '1'
end
local mode = ARGV[8]
local target
local popped = 0
if mode == 'rollback' then
  if cur == 0 then return redis.error_reply('ALIAS_NOT_FOUND alias ' .. ARGV[2] .. ' is not set') end
  local history = redis.call('LRANGE', KEYS[4], 0, -1)
  for i, entry in ipairs(history) do
    local v = tonumber(entry)
    if v ~= cur and usable(v) then target = v; popped = i; break end
  end
  if not target then
    return redis.error_reply('NO_PREVIOUS_VERSION alias ' .. ARGV[2] .. ' has no earlier usable version')
  end
else
  target = tonumber(ARGV[3])
  if not redis.call('ZSCORE', KEYS[2], target) then
    return redis.error_reply('VERSION_NOT_FOUND version ' .. target .. ' of ' .. ARGV[1] .. ' not found')
  end
  if redis.call('HGET', KEYS[6] .. target, 'deleted') == '1' then
    return redis.error_reply('ARTIFACT_DELETED version ' .. target .. ' was garbage-collected')
  end
  if mode == 'rollback-to' then
    if cur == 0 then return redis.error_reply('ALIAS_NOT_FOUND alias ' .. ARGV[2] .. ' is not set') end
    if target >= cur then
      return redis.error_reply('NOT_OLDER rollback target ' .. target .. ' is not older than ' .. cur)
    end
  end
end
if popped > 0 then
  redis.call('LTRIM', KEYS[4], popped, -1)
elseif cur ~= 0 and cur ~= target then
  redis.call('LPUSH', KEYS[4], cur)
  redis.call('LTRIM', KEYS[4], 0, 999)
end
redis.call('HSET', KEYS[3], ARGV[2], target)
local cause = 'set'
if mode ~= 'set' then cause = 'rollback' end
local id = emit(KEYS[5], ARGV[7], {type='ALIAS_SET', adapter=ARGV[1], version=target, alias=ARGV[2],
  previous=cur, time=ARGV[5], actor=ARGV[6], cause=cause, aliases=alias_map(KEYS[3]), serving=serving_of(KEYS[1])})
return {cur, target, id}
"""
)

# KEYS: adapter, aliases, history, events   ARGV: name, alias, expected, now_ms, actor, maxlen
DELETE_ALIAS = (
    _EMIT
    + """
local err = live_adapter(KEYS[1], ARGV[1]); if err then return err end
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if not cur then return redis.error_reply('ALIAS_NOT_FOUND alias ' .. ARGV[2] .. ' of ' .. ARGV[1] .. ' not found') end
if ARGV[3] ~= '' and tonumber(ARGV[3]) ~= tonumber(cur) then
  return redis.error_reply('VERSION_CONFLICT alias ' .. ARGV[2] .. ' points to ' .. cur .. ', expected ' .. ARGV[3])
end
if serving_of(KEYS[1]) == ARGV[2] then
  return redis.error_reply('ALIAS_SERVING alias ' .. ARGV[2] .. ' is the serving alias of ' .. ARGV[1] ..
    ': bare names resolve to it; point serving elsewhere first (opentinker registry alias serve ' .. ARGV[1] ..
    ' latest)')
end
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
local id = emit(KEYS[4], ARGV[6], {type='ALIAS_DELETED', adapter=ARGV[1], alias=ARGV[2], previous=cur,
  time=ARGV[4], actor=ARGV[5], cause='delete', aliases=alias_map(KEYS[2]), serving=serving_of(KEYS[1])})
return {tonumber(cur), id}
"""
)

# Marks a version's artifact collected unless an alias points at it now (checked atomically here), and when
# it was the artifact's last reference, claims the bytes for deletion in the same step.
# KEYS: version, aliases, events, artifact_refs, adapter, uploaders, leases, deleting, uploads
# ARGV: name, version, now_ms, actor, maxlen, cutoff_ms, tenant_prefix
# Returns {versions still referencing the artifact (-1: skipped), 1 if the bytes are claimed else 0}.
COLLECT_VERSION = (
    _EMIT
    + _CLAIM
    + """
if redis.call('HGET', KEYS[1], 'deleted') ~= '0' then return {-1, 0} end
local flat = redis.call('HGETALL', KEYS[2])
for i = 2, #flat, 2 do if tonumber(flat[i]) == tonumber(ARGV[2]) then return {-1, 0} end end
local sha = redis.call('HGET', KEYS[1], 'artifact_sha256')
redis.call('HSET', KEYS[1], 'deleted', '1')
redis.call('SREM', KEYS[4], ARGV[1] .. '@' .. ARGV[2])
emit(KEYS[3], ARGV[5], {type='ARTIFACT_DELETED', adapter=ARGV[1], version=ARGV[2], time=ARGV[3],
  actor=ARGV[4], cause='gc', artifact=sha, aliases=alias_map(KEYS[2]), serving=serving_of(KEYS[5])})
local remaining = redis.call('SCARD', KEYS[4])
local claimed = 0
if remaining == 0 then
  claimed = claim_artifact(KEYS[4], KEYS[6], KEYS[7], KEYS[8], KEYS[9], ARGV[7], sha, ARGV[3], ARGV[6])
end
return {remaining, claimed}
"""
)

# Names the alias bare names resolve to ('latest' clears it). The alias must be set, except latest.
# KEYS: adapter, aliases, events   ARGV: name, alias, now_ms, actor, maxlen
# Returns {previous alias ('latest' if none), version a bare name serves now (0: none yet), event id}.
SET_SERVING_ALIAS = (
    _EMIT
    + """
local err = live_adapter(KEYS[1], ARGV[1]); if err then return err end
local previous = serving_of(KEYS[1])
if previous == '' then previous = 'latest' end
local version = redis.call('HGET', KEYS[2], ARGV[2])
if ARGV[2] == 'latest' then
  redis.call('HDEL', KEYS[1], 'serving')
else
  if not version then
    return redis.error_reply('ALIAS_NOT_FOUND alias ' .. ARGV[2] .. ' of ' .. ARGV[1] ..
      ' is not set: set it first (opentinker registry alias set ' .. ARGV[1] .. ' ' .. ARGV[2] .. ' N)')
  end
  redis.call('HSET', KEYS[1], 'serving', ARGV[2])
end
local id = emit(KEYS[3], ARGV[5], {type='SERVING_ALIAS_SET', adapter=ARGV[1], version=version or 0,
  alias=ARGV[2], time=ARGV[3], actor=ARGV[4], cause='serve', aliases=alias_map(KEYS[2]),
  serving=serving_of(KEYS[1])})
return {previous, tonumber(version or '0'), id}
"""
)

# The sweep of unpublished uploads: an artifact some version uses is settled (the version GC owns it), one
# uploaded again since cutoff is kept, else it is claimed like the last reference's collection claims it. One
# the sweep listed that is no longer waiting (published or claimed since) is not the sweep's to decide on.
# KEYS: refs, uploaders, leases, deleting, uploads   ARGV: sha256, now_ms, cutoff_ms, tenant_prefix
# Returns 1 when claimed, 0 when kept, -1 when settled.
CLAIM_UPLOAD = (
    _CLAIM
    + """
if not redis.call('ZSCORE', KEYS[5], ARGV[1]) then return 0 end
if redis.call('SCARD', KEYS[1]) > 0 then
  redis.call('ZREM', KEYS[5], ARGV[1])
  return -1
end
return claim_artifact(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[4], ARGV[1], ARGV[2], ARGV[3])
"""
)

# Objects a trainer pushed straight to the bucket and never published (the registry never saw them: no upload
# record). The caller found them older than the grace period by their own timestamps; like any claim, refused
# while a version uses the digest, a publish or upload holds its lease, or the registry recorded a newer upload.
# KEYS: refs, uploaders, leases, deleting, uploads   ARGV: sha256, now_ms, cutoff_ms, tenant_prefix
# Returns 1 when claimed for deletion, 0 when kept.
CLAIM_ORPHAN = (
    _CLAIM
    + """
return claim_artifact(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[4], ARGV[1], ARGV[2], ARGV[3])
"""
)

# A lease keeps an artifact's bytes from being claimed until the publish or upload that took it is done.
# KEYS: leases, deleting   ARGV: sha256, lease_id, expiry_ms
# Returns 0 while the artifact's deletion is under way (its bytes are going), 1 when leased.
LEASE_ARTIFACT = """
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
return 1
"""

# Check and reservation in one step, so two uploads can never both pass a nearly full quota. Expired
# reservations (a registry that died mid-upload) stop counting. Renewing a live reservation does not check again.
# KEYS: tenant_uploads, tenant_reserved   ARGV: upload_id, bytes, quota, now_ms, expiry_ms
# Returns {1, bytes counted with this upload} when reserved, {0, bytes counted without it} when refused.
RESERVE_QUOTA = """
local now = tonumber(ARGV[4])
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held then
  local size, expiry = string.match(held, '^(%d+) (%d+)$')
  if tonumber(expiry) > now then
    redis.call('HSET', KEYS[2], ARGV[1], size .. ' ' .. ARGV[5])
    return {1, -1}
  end
end
local used = 0
for _, size in ipairs(redis.call('HVALS', KEYS[1])) do used = used + tonumber(size) end
local expired = {}
local flat = redis.call('HGETALL', KEYS[2])
for i = 1, #flat, 2 do
  local size, expiry = string.match(flat[i + 1], '^(%d+) (%d+)$')
  if tonumber(expiry) <= now then table.insert(expired, flat[i])
  elseif flat[i] ~= ARGV[1] then used = used + tonumber(size) end
end
if used + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return {0, used} end
for _, id in ipairs(expired) do redis.call('HDEL', KEYS[2], id) end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. ARGV[5])
return {1, used + tonumber(ARGV[2])}
"""

# A committed upload: counted to its tenant, its reservation and lease released, in one step. The lease must
# still be there: if a claim took it (it expired first), the bytes this upload relied on may be gone.
# KEYS: uploaders, tenant_uploads, uploads, leases, tenant_reserved
# ARGV: sha256, tenant, bytes, now_ms, lease_id, upload_id ('' = no reservation)
RECORD_UPLOAD = """
if not redis.call('ZSCORE', KEYS[4], ARGV[5]) then
  return redis.error_reply('ARTIFACT_LEASE_EXPIRED the upload of sha256:' .. ARGV[1] ..
    ' took longer than its lease and the artifact was garbage-collected meanwhile: upload it again')
end
redis.call('SADD', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[5])
if ARGV[6] ~= '' then redis.call('HDEL', KEYS[5], ARGV[6]) end
return 1
"""
