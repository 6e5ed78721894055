"""Lua scripts of the trainer pool's placements (placement_store.py): each change of owner is one compare-and-set
on the adapter's epoch, so two registries (or two racing callers) never both hand an adapter out.

Redis layout:
    ot:placement:{adapter}         hash: replica_id, address, epoch, rank, place_ms, state_id, state_step, base
    ot:placements:{replica_id}     hash adapter -> rank: what is placed on a trainer (its load, its beat's list)

Which trainer is least loaded is chosen in Python (replica records are protos Lua cannot read); the scripts
re-check what the choice relied on: the epoch it read, the old owner's lease gone, the new owner's lease live.
"""

from __future__ import annotations

# Shared prologue: the placement hash as a flat list (what the store parses), and the hand-over itself.
_HAND_OVER = """
local function hand_over(pkey, old_index, new_index, adapter, rid, address, epoch, rank, now)
  local old = redis.call('HGET', pkey, 'replica_id')
  if old then redis.call('HDEL', old_index, adapter) end
  redis.call('HSET', pkey, 'replica_id', rid, 'address', address, 'epoch', epoch, 'rank', rank, 'place_ms', now)
  redis.call('HSET', new_index, adapter, rank)
  return redis.call('HGETALL', pkey)
end
"""

# KEYS: placement, old owner's index, new owner's index, old owner's replica key, new owner's replica key
# ARGV: adapter, expected epoch ('0': none yet), replica_id, address, rank, now_ms, the new owner's base
# 'RACE' when what the choice read has changed (the caller reads again and retries).
PLACE_ADAPTER = (
    _HAND_OVER
    + """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
if epoch ~= tonumber(ARGV[2]) then return 'RACE' end
if epoch > 0 and redis.call('EXISTS', KEYS[4]) == 1 then return 'RACE' end
if redis.call('EXISTS', KEYS[5]) == 0 then return 'RACE' end
redis.call('HSET', KEYS[1], 'base', ARGV[7])
return hand_over(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[3], ARGV[4], epoch + 1, ARGV[5], ARGV[6])
"""
)

# KEYS: placement, old owner's index, new owner's index, new owner's replica key
# ARGV: adapter, expected epoch, replica_id, address, now_ms, state_id, state_step
MOVE_PLACEMENT = (
    _HAND_OVER
    + """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then return redis.error_reply('PLACEMENT_NOT_FOUND adapter ' .. ARGV[1] .. ' is not placed') end
if tonumber(epoch) ~= tonumber(ARGV[2]) then
  return redis.error_reply('STALE_EPOCH adapter ' .. ARGV[1] .. ' is at epoch ' .. epoch .. ', not ' .. ARGV[2])
end
if redis.call('EXISTS', KEYS[4]) == 0 then return 'RACE' end
local rank = redis.call('HGET', KEYS[1], 'rank') or '0'
redis.call('HSET', KEYS[1], 'state_id', ARGV[6], 'state_step', ARGV[7])
return hand_over(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[3], ARGV[4], tonumber(epoch) + 1, rank, ARGV[5])
"""
)

# KEYS: placement   ARGV: adapter, epoch, state_id, state_step
RECORD_PLACEMENT_STATE = """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch then return redis.error_reply('PLACEMENT_NOT_FOUND adapter ' .. ARGV[1] .. ' is not placed') end
if tonumber(epoch) ~= tonumber(ARGV[2]) then
  return redis.error_reply('STALE_EPOCH adapter ' .. ARGV[1] .. ' is at epoch ' .. epoch .. ', not ' .. ARGV[2])
end
redis.call('HSET', KEYS[1], 'state_id', ARGV[3], 'state_step', ARGV[4])
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: placement   ARGV: adapter
DROP_PLACEMENT = """
local rid = redis.call('HGET', KEYS[1], 'replica_id')
if rid then redis.call('HDEL', 'ot:placements:' .. rid, ARGV[1]) end
return redis.call('DEL', KEYS[1])
"""
