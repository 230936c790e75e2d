"""The state store's Lua scripts (redis_store.py): each runs atomically on the slot's
master, fenced where it writes by the epoch it is given."""

# Admits a label value while fewer than the cap were used within the idle time; atomic
# across replicas. KEYS[1] zset value -> last use (ms); ARGV value, cap, cutoff, now.
ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[1])
  return 1
end
return 0
"""

# A checkpoint (store.PartitionCheckpoint), all or nothing. KEYS: meta, queries, open, buckets, offsets, ab,
# then one HyperLogLog per arm with users to add (pipeline/users.py), in the order of the last section.
# ARGV: epoch, layout, the mark expected (the owner's last), then counted sections: records (id, record), deadlines (score, id),
# buckets, offsets, watermarks and metadata, arm sums (field, value); deleted records,
# dropped buckets, deleted metadata fields (ids); per arm key, its users (counted lists).
# Returns 1 when written, 0 when another owner holds a newer epoch, -1 when the state is gone,
# -2 when the stored mark is not the owner's last (Redis lost the last checkpoints).
COMMIT = """
local epoch = redis.pcall('HGET', KEYS[1], 'epoch')
if type(epoch) == 'table' then return 0 end  -- the meta of another type: no epoch is ours (claimed anew)
if not epoch then return -1 end
if epoch ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[1], 'mark') or '') ~= ARGV[3] then return -2 end
-- A key of another type holds nothing readable (the claim read it as empty): replaced before
-- any write, so the script never fails midway (a script is not rolled back).
for k, want in pairs({[2] = 'hash', [3] = 'zset', [4] = 'hash', [5] = 'hash', [6] = 'hash'}) do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if t ~= want and t ~= 'none' then redis.call('DEL', KEYS[k]) end
end
local i = 4
local function section(width, apply)
  local n = tonumber(ARGV[i]) * width
  i = i + 1
  -- unpack() is bounded by Lua's C stack: chunks of 4000 arguments
  for s = i, i + n - 1, 4000 do apply(s, math.min(s + 3999, i + n - 1)) end
  i = i + n
end
-- Users first (a script is not rolled back); a key no valid HyperLogLog fails PFADD: left as it
-- is, unreadable, so the looks leave the user test out (a reset would under-count the arm).
local users = i
for _, width in ipairs({2, 2, 2, 2, 2, 2, 1, 1, 1}) do users = users + 1 + tonumber(ARGV[users]) * width end
for k = 7, #KEYS do
  local n = tonumber(ARGV[users])
  for s = users + 1, users + n, 4000 do
    local e = math.min(s + 3999, users + n)
    redis.pcall('PFADD', KEYS[k], unpack(ARGV, s, e))
  end
  users = users + 1 + n
end
section(2, function(a, b) redis.call('HSET', KEYS[2], unpack(ARGV, a, b)) end)
section(2, function(a, b) redis.call('ZADD', KEYS[3], unpack(ARGV, a, b)) end)
section(2, function(a, b) redis.call('HSET', KEYS[4], unpack(ARGV, a, b)) end)
section(2, function(a, b) redis.call('HSET', KEYS[5], unpack(ARGV, a, b)) end)
section(2, function(a, b) redis.call('HSET', KEYS[1], unpack(ARGV, a, b)) end)
section(2, function(a, b) redis.call('HSET', KEYS[6], unpack(ARGV, a, b)) end)
section(1, function(a, b)
  redis.call('HDEL', KEYS[2], unpack(ARGV, a, b))
  redis.call('ZREM', KEYS[3], unpack(ARGV, a, b))
end)
section(1, function(a, b) redis.call('HDEL', KEYS[4], unpack(ARGV, a, b)) end)
section(1, function(a, b) redis.call('HDEL', KEYS[1], unpack(ARGV, a, b)) end)
redis.call('HSET', KEYS[1], 'layout', ARGV[2])
return 1
"""


# Deletes a partition's state but its epoch, while `epoch` is the stored one (ARGV[1]; ''
# for any). KEYS: meta, queries, open, buckets, offsets, ab (one slot). Returns 1 or 0.
WIPE = """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if ARGV[1] ~= '' and epoch ~= ARGV[1] then return 0 end
redis.call('DEL', unpack(KEYS))
if epoch then redis.call('HSET', KEYS[1], 'epoch', epoch) end
return 1
"""

# Replaces a stored epoch HINCRBY cannot increment (not an integer, near overflow, or the
# meta of another type, then replaced by a hash of the epoch alone) by
# ARGV[1] (a time in ms: no owner holds it), atomically: of two replicas repairing at once,
# the second sees the first's integer and leaves it, so their claims get distinct epochs.
REPAIR_EPOCH = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'hash' and t ~= 'none' then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
  return 1
end
local e = redis.call('HGET', KEYS[1], 'epoch')
if e and (not string.match(e, '^[1-9]%d*$') or #e > 15) and e ~= '0' then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1])
  return 1
end
return 0
"""

# Writes partition 0's holder's A/B state while ARGV[1] is partition 0's stored epoch.
# KEYS: partition 0's meta, the target. ARGV: epoch, then HSET's field/values (SAVE) or
# the line and how many to keep (APPEND). Returns 1, or 0 for a stale holder.
# A running hash (KEYS[2]) written while ARGV[1] is partition 0's epoch (KEYS[1]); a key of
# another type there holds nothing readable and is replaced. ARGV: epoch, then field, value...
SAVE = """
if redis.pcall('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end  -- (an error table: not ours)
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[2]) end
-- unpack() is bounded by Lua's C stack: chunks of 4000 arguments
for s = 2, #ARGV, 4000 do redis.call('HSET', KEYS[2], unpack(ARGV, s, math.min(s + 3999, #ARGV))) end
return 1
"""
# A looks list (KEYS[2]) appended to and trimmed, the same way; a key of another type replaced.
APPEND = """
if redis.pcall('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end  -- (an error table: not ours)
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'list' and t ~= 'none' then redis.call('DEL', KEYS[2]) end
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[3]), -1)
return 1
"""

# The SHA-1 (hex) of a string key's value, computed where it is stored: a large definition
# is compared without being sent. KEYS[1]. Returns false when no key, '' when no string.
DIGEST = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'none' then return false end
if t ~= 'string' then return '' end
return redis.sha1hex(redis.call('GET', KEYS[1]))
"""
