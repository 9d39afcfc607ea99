"""The Lua scripts ``RedisDirectory`` runs server-side: ``LOOKUP`` (the leading run of page
entries whose owners' leases are held by the same incarnation, one round trip), ``REMOVE``
(drop a session's entries that still name this incarnation), ``BEAT`` and ``LEAVE`` (the
lease refreshed or dropped only while this incarnation holds it: compare-and-set) and
``PURGE`` (at join: every entry a dead incarnation of this node id left behind).

Values: a lease is ``inc|endpoint|mac``, a page entry ``node|inc|mac``; the MACs are checked
by the caller (a Redis writer without the cluster secret cannot make one)."""

LOOKUP = """
local lease_prefix = ARGV[1]
local owners, eps, entries, seen = {}, {}, {}, {}
for i = 1, #KEYS do
  local e = redis.call('GET', KEYS[i])
  if not e then break end
  local bar = string.find(e, '|', 1, true)
  if not bar then break end
  local bar2 = string.find(e, '|', bar + 1, true)
  if not bar2 then break end
  local node, inc = string.sub(e, 1, bar - 1), string.sub(e, bar + 1, bar2 - 1)
  local lease = seen[node]
  if lease == nil then
    lease = redis.call('GET', lease_prefix .. node) or false
    seen[node] = lease
    if lease then
      local lb = string.find(lease, '|', 1, true)
      if lb and string.sub(lease, 1, lb - 1) == inc then
        table.insert(eps, node); table.insert(eps, string.sub(lease, lb + 1))
      else
        seen[node] = false
        lease = false
      end
    end
  end
  if not lease then break end
  if string.sub(lease, 1, string.find(lease, '|', 1, true) - 1) ~= inc then break end
  table.insert(owners, node)
  table.insert(entries, e)
end
return {owners, eps, entries}
"""

REMOVE = """
local mine, n = ARGV[1], 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local e = redis.call('GET', ARGV[2] .. k)
  if e and string.sub(e, 1, #mine) == mine then redis.call('DEL', ARGV[2] .. k); n = n + 1 end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return n
"""

BEAT = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""

LEAVE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

PURGE = """
local node, mine, n = ARGV[1], ARGV[2], 0
for _, sk in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local at = string.find(sk, ':s:', 1, true)
  if at then
    local prefix = string.sub(sk, 1, at - 1) .. ':p:'
    for _, k in ipairs(redis.call('SMEMBERS', sk)) do
      local e = redis.call('GET', prefix .. k)
      if e and string.sub(e, 1, #node) == node and string.sub(e, 1, #mine) ~= mine then
        redis.call('DEL', prefix .. k); n = n + 1
      end
    end
  end
  redis.call('DEL', sk)
end
redis.call('DEL', KEYS[1])
return n
"""
