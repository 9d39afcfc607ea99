"""The Lua scripts ``RedisDirectory`` runs server-side: ``LOOKUP`` (the leading run of page
entries whose owners' leases are held by the same incarnation, one round trip, and the
entry the run stopped at when one was there), ``REMOVE``
(drop a session's entries that still name this incarnation), ``BEAT`` and ``LEAVE`` (the
lease refreshed or dropped only while this incarnation holds it: compare-and-set) and
``PURGE`` (at join: every entry a dead incarnation of this node id left behind).

Values: a lease is ``inc|endpoint|mac``, a page entry ``node|inc|mac``; the MACs are checked
by the caller (a Redis writer without the cluster secret cannot make one).  Every read goes
through ``get`` (``redis.pcall``): a key a Redis writer turned into another type reads as
junk (``''``) or absent, never as a script error that would fail the whole call."""

GET = """
local function get(k)
  local v = redis.pcall('GET', k)
  if type(v) == 'string' then return v end
  if type(v) == 'table' then return '' end
  return false
end
"""

LOOKUP = GET + """
local lease_prefix = ARGV[1]
local owners, eps, entries, seen = {}, {}, {}, {}
local stop = {}
for i = 1, #KEYS do
  local e = get(KEYS[i])
  if not e then break end
  stop = {e}
  local bar = string.find(e, '|', 1, true)
  if not bar then break end
  local bar2 = string.find(e, '|', bar + 1, true)
  if not bar2 then break end
  local node, inc = string.sub(e, 1, bar - 1), string.sub(e, bar + 1, bar2 - 1)
  local lease = seen[node]
  if lease == nil then
    lease = get(lease_prefix .. node)
    seen[node] = lease
    if lease then
      local lb = string.find(lease, '|', 1, true)
      if lb and string.sub(lease, 1, lb - 1) == inc then
        table.insert(eps, node); table.insert(eps, lease)
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
  stop = {}
end
return {owners, eps, entries, stop}
"""

REMOVE = GET + """
local mine, n = ARGV[1], 0
local members = redis.pcall('SMEMBERS', KEYS[1])
if type(members) ~= 'table' or members.err then members = {} end
for _, k in ipairs(members) do
  local e = get(ARGV[2] .. k)
  if e and string.sub(e, 1, #mine) == mine then redis.call('DEL', ARGV[2] .. k); n = n + 1 end
end
redis.call('DEL', KEYS[1])
redis.pcall('SREM', KEYS[2], KEYS[1])
return n
"""

# ARGV: this lease's value, its ttl (ms), then '1' and the value the caller saw to overwrite
# that value (junk: not a valid lease of this node id) if it is still there.  Returns 1 when
# the lease is this value now, else the value found ('' for a key of another type).
BEAT = GET + """
local v = get(KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
if (not v) or (ARGV[3] == '1' and v == ARGV[4]) then
  redis.call('DEL', KEYS[1]); redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1
end
return v
"""

LEAVE = GET + """
if get(KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

PURGE = GET + """
local function members(k)
  local m = redis.pcall('SMEMBERS', k)
  if type(m) ~= 'table' or m.err then return {} end
  return m
end
local node, mine, n = ARGV[1], ARGV[2], 0
for _, sk in ipairs(members(KEYS[1])) do
  local at = string.find(sk, ':s:', 1, true)
  if at then
    local prefix = string.sub(sk, 1, at - 1) .. ':p:'
    for _, k in ipairs(members(sk)) do
      local e = get(prefix .. k)
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
