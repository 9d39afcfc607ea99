"""The Lua scripts ``RedisDirectory`` runs server-side: ``LOOKUP`` (the leading run of
page keys whose owners' leases are held by the same incarnation, one round trip) and
``REMOVE`` (drop a session's entries that still name this node)."""

LOOKUP = """
local lease_prefix = ARGV[1]
local owners, eps, seen = {}, {}, {}
for i = 1, #KEYS do
  local e = redis.call('GET', KEYS[i])
  if not e then break end
  local bar = string.find(e, '|', 1, true)
  if not bar then break end
  local node, inc = string.sub(e, 1, bar - 1), string.sub(e, bar + 1)
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
end
return {owners, eps}
"""

REMOVE = """
local mine, n = ARGV[1], 0
for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('GET', ARGV[2] .. k) == mine then redis.call('DEL', ARGV[2] .. k); n = n + 1 end
end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return n
"""
